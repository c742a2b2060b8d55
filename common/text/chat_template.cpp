#include "common/text/chat_template.h"

#include <fmt/format.h>

#include <array>
#include <utility>

#include "common/error.h"
#include "common/model/gguf.h"

namespace duet {

namespace {

constexpr std::array<std::pair<std::string_view, ChatTemplateKind>, 8> kNames = {{
    {"chatml", ChatTemplateKind::kChatMl},
    {"llama3", ChatTemplateKind::kLlama3},
    {"gemma", ChatTemplateKind::kGemma},
    {"mistral-v1", ChatTemplateKind::kMistralV1},
    {"mistral-v3", ChatTemplateKind::kMistralV3},
    {"mistral-v3-tekken", ChatTemplateKind::kMistralV3Tekken},
    {"mistral-v7", ChatTemplateKind::kMistralV7},
    {"mistral-v7-tekken", ChatTemplateKind::kMistralV7Tekken},
}};

[[noreturn]] void refuse(std::string_view family, std::string_view text) {
  throw Error(ErrorKind::kUnsupported,
              fmt::format("unsupported chat template ({}; supported: ChatML, Llama 3, Gemma, "
                          "Mistral v1/v3/v3-tekken/v7; --chat-template NAME picks one); it "
                          "begins: {:.60}",
                          family, text));
}

// llama.cpp's trim: isspace characters off both ends.
std::string_view trim(std::string_view s) {
  constexpr std::string_view kSpace = " \t\n\v\f\r";
  const size_t begin = s.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return s.substr(begin, s.find_last_not_of(kSpace) - begin + 1);
}

// The prompt being rendered and where each piece of content sits in it.
class Prompt {
 public:
  explicit Prompt(std::vector<Tokenizer::TextRange>* content) : content_(content) {}

  void markup(std::string_view s) { out_ += s; }
  void text(std::string_view s) {
    if (content_ != nullptr && !s.empty())
      content_->push_back({out_.size(), out_.size() + s.size()});
    out_ += s;
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
  std::vector<Tokenizer::TextRange>* content_;
};

void check_role(const ChatMessage& m) {
  DUET_REQUIRE(m.role == "system" || m.role == "user" || m.role == "assistant",
               "unknown chat role '{}'", m.role);
}

void render_mistral(ChatTemplateKind kind, const std::vector<ChatMessage>& messages, Prompt& p) {
  if (kind == ChatTemplateKind::kMistralV7 || kind == ChatTemplateKind::kMistralV7Tekken) {
    const std::string_view space = kind == ChatTemplateKind::kMistralV7 ? " " : "";
    for (const ChatMessage& m : messages) {
      if (m.role == "system") {
        p.markup(fmt::format("[SYSTEM_PROMPT]{}", space));
        p.text(m.content);
        p.markup("[/SYSTEM_PROMPT]");
      } else if (m.role == "user") {
        p.markup(fmt::format("[INST]{}", space));
        p.text(m.content);
        p.markup("[/INST]");
      } else {
        p.markup(space);
        p.text(m.content);
        p.markup("</s>");
      }
    }
    return;
  }
  const std::string_view leading = kind == ChatTemplateKind::kMistralV1 ? " " : "";
  const std::string_view trailing = kind == ChatTemplateKind::kMistralV3Tekken ? "" : " ";
  const bool trim_assistant = kind == ChatTemplateKind::kMistralV3;
  bool inside_turn = false;
  for (const ChatMessage& m : messages) {
    if (!inside_turn) {
      p.markup(fmt::format("{}[INST]{}", leading, trailing));
      inside_turn = true;
    }
    if (m.role == "system") {
      p.text(m.content);
      p.markup("\n\n");
    } else if (m.role == "user") {
      p.text(m.content);
      p.markup(fmt::format("{}[/INST]", leading));
    } else {
      p.markup(trailing);
      p.text(trim_assistant ? trim(m.content) : std::string_view(m.content));
      p.markup("</s>");
      inside_turn = false;
    }
  }
}

std::string render(ChatTemplateKind kind, const std::vector<ChatMessage>& messages,
                   std::vector<Tokenizer::TextRange>* content) {
  for (const ChatMessage& m : messages) check_role(m);
  Prompt p(content);
  switch (kind) {
    case ChatTemplateKind::kChatMl:
      for (const ChatMessage& m : messages) {
        p.markup("<|im_start|>" + m.role + "\n");
        p.text(m.content);
        p.markup("<|im_end|>\n");
      }
      p.markup("<|im_start|>assistant\n");
      break;
    case ChatTemplateKind::kLlama3:
      for (const ChatMessage& m : messages) {
        p.markup("<|start_header_id|>" + m.role + "<|end_header_id|>\n\n");
        p.text(trim(m.content));
        p.markup("<|eot_id|>");
      }
      p.markup("<|start_header_id|>assistant<|end_header_id|>\n\n");
      break;
    case ChatTemplateKind::kGemma: {
      std::string system;  // merged into the next user turn: Gemma has no system role
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          system += trim(m.content);
          continue;
        }
        const bool model = m.role == "assistant";
        p.markup(model ? "<start_of_turn>model\n" : "<start_of_turn>" + m.role + "\n");
        if (!system.empty() && !model) {
          p.text(system);
          p.markup("\n\n");
          system.clear();
        }
        p.text(trim(m.content));
        p.markup("<end_of_turn>\n");
      }
      p.markup("<start_of_turn>model\n");
      break;
    }
    case ChatTemplateKind::kMistralV1:
    case ChatTemplateKind::kMistralV3:
    case ChatTemplateKind::kMistralV3Tekken:
    case ChatTemplateKind::kMistralV7:
    case ChatTemplateKind::kMistralV7Tekken:
      render_mistral(kind, messages, p);
      break;
  }
  return p.take();
}

}  // namespace

ChatTemplateKind detect_chat_template(std::string_view text) {
  for (const auto& [name, kind] : kNames) {
    if (text == name) return kind;
  }
  const auto has = [text](std::string_view marker) {
    return text.find(marker) != std::string_view::npos;
  };
  // llama.cpp's order of tests, each family it would pick refused by name
  // where Duet does not render it.
  if (has("<|im_start|>")) {
    if (has("<|im_sep|>")) refuse("Phi-4", text);
    if (has("<end_of_utterance>")) refuse("SmolVLM", text);
    return ChatTemplateKind::kChatMl;
  }
  if (text.starts_with("mistral") || has("[INST]")) {
    if (has("[SYSTEM_PROMPT]")) return ChatTemplateKind::kMistralV7;
    if (has("' [INST] ' + system_message") || has("[AVAILABLE_TOOLS]")) {
      if (has(" [INST]")) return ChatTemplateKind::kMistralV1;
      if (has("\"[INST]\"")) return ChatTemplateKind::kMistralV3Tekken;
      return ChatTemplateKind::kMistralV3;
    }
    refuse("Llama 2", text);
  }
  if (has("<|assistant|>") && has("<|end|>")) refuse("Phi-3", text);
  if (has("[gMASK]<sop>")) refuse("ChatGLM 4", text);
  if (has("<|assistant|>") && has("<|user|>")) refuse("EXAONE, Falcon 3 or GLM-Edge", text);
  if (has("<|{{ item['role'] }}|>") && has("<|begin_of_image|>")) refuse("GLM-Edge", text);
  if (has("<|user|>") && has("<|endoftext|>")) refuse("Zephyr", text);
  if (has("bos_token + message['role']")) refuse("Monarch", text);
  if (has("<start_of_turn>")) return ChatTemplateKind::kGemma;
  if (has("'\\n\\nAssistant: ' + eos_token")) refuse("Orion", text);
  if (has("GPT4 Correct ")) refuse("OpenChat", text);
  if (has("USER: ") && has("ASSISTANT: ")) refuse("Vicuna", text);
  if (has("### Instruction:") && has("<|EOT|>")) refuse("DeepSeek Coder", text);
  if (has("<|START_OF_TURN_TOKEN|>") && has("<|USER_TOKEN|>")) refuse("Command R", text);
  if (has("<|start_header_id|>") && has("<|end_header_id|>")) return ChatTemplateKind::kLlama3;
  refuse("not one Duet knows", text);
}

ChatTemplateKind model_chat_template(const GgufFile& file, std::string_view chosen) {
  if (!chosen.empty()) return detect_chat_template(chosen);
  const std::optional<std::string> text = file.get_string("tokenizer.chat_template");
  if (!text) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("{}: the model has no chat template (--chat-template NAME gives one)",
                            file.name()));
  }
  return detect_chat_template(*text);
}

std::string_view chat_template_name(ChatTemplateKind kind) {
  for (const auto& [name, k] : kNames) {
    if (k == kind) return name;
  }
  return "?";
}

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
