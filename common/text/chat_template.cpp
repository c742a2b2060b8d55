#include "common/text/chat_template.h"

#include <fmt/format.h>

#include "common/error.h"

namespace duet {

ChatTemplateKind detect_chat_template(std::string_view template_text) {
  if (template_text.find("<|im_start|>") != std::string_view::npos)
    return ChatTemplateKind::kChatMl;
  throw Error(ErrorKind::kUnsupported,
              fmt::format("unsupported chat template (supported: ChatML); it begins: {:.60}",
                          template_text));
}

namespace {

// The rendered prompt and where each message's content sits in it.
std::string render(ChatTemplateKind kind, const std::vector<ChatMessage>& messages,
                   std::vector<Tokenizer::TextRange>* content) {
  std::string out;
  switch (kind) {
    case ChatTemplateKind::kChatMl:
      for (const ChatMessage& m : messages) {
        DUET_REQUIRE(m.role == "system" || m.role == "user" || m.role == "assistant",
                     "unknown chat role '{}'", m.role);
        out += "<|im_start|>" + m.role + "\n";
        if (content != nullptr) content->push_back({out.size(), out.size() + m.content.size()});
        out += m.content + "<|im_end|>\n";
      }
      out += "<|im_start|>assistant\n";
      break;
  }
  return out;
}

}  // namespace

std::string apply_chat_template(ChatTemplateKind kind, const std::vector<ChatMessage>& messages) {
  return render(kind, messages, nullptr);
}

std::vector<TokenId> encode_chat(const Tokenizer& tokenizer, ChatTemplateKind kind,
                                 const std::vector<ChatMessage>& messages) {
  std::vector<Tokenizer::TextRange> content;
  const std::string text = render(kind, messages, &content);
  return tokenizer.encode(text, /*add_special=*/true, /*parse_special=*/true, content);
}

}  // namespace duet
