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

std::string apply_chat_template(ChatTemplateKind kind, const std::vector<ChatMessage>& messages) {
  std::string out;
  switch (kind) {
    case ChatTemplateKind::kChatMl:
      for (const ChatMessage& m : messages) {
        DUET_REQUIRE(m.role == "system" || m.role == "user" || m.role == "assistant",
                     "unknown chat role '{}'", m.role);
        out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
      }
      out += "<|im_start|>assistant\n";
      break;
  }
  return out;
}

}  // namespace duet
