// Chat prompts from a model's template.
//
// Duet recognizes templates by their markers instead of running Jinja, as
// llama.cpp's built-in renderer does (llm_chat_detect_template and
// llm_chat_apply_template in its src/llama-chat.cpp), and renders the
// families it takes byte for byte as that renderer does
// (tests/golden/chat_templates.json records its answers):
//   ChatML    <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
//             (Qwen2, Qwen3, SmolLM); no system prompt is added when the
//             conversation has none
//   Llama 3   <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>,
//             content trimmed
//   Gemma     <start_of_turn>user|model\ncontent<end_of_turn>\n, content
//             trimmed, the system prompt put before the next user turn
//   Mistral   v1, v3, v3-tekken: [INST] turns, spaces by version; v7 (and
//             v7-tekken, by name only): [SYSTEM_PROMPT] and [INST] turns. These
//             end at [/INST]: llama.cpp opens no assistant turn for them.
// Templates llama.cpp detects as another family (Llama 2, Phi, Zephyr, ...)
// or not at all are refused, naming what was seen.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/text/tokenizer.h"

namespace duet {

class GgufFile;

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

enum class ChatTemplateKind {
  kChatMl,
  kLlama3,
  kGemma,
  kMistralV1,
  kMistralV3,
  kMistralV3Tekken,
  kMistralV7,
  kMistralV7Tekken,
};

// The kind of a template: `template_text` is a model's tokenizer.chat_template
// or one of llama.cpp's names for these kinds ("chatml", "llama3", "gemma",
// "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7",
// "mistral-v7-tekken", as `--chat-template` takes them). Throws kUnsupported
// for templates Duet does not take, naming what it saw.
ChatTemplateKind detect_chat_template(std::string_view template_text);

// The template a model's chats take: `chosen` (`--chat-template`: a name or a
// template text) when it is not empty, else the file's tokenizer.chat_template.
// Throws kUnsupported when that is not one Duet takes, or the file has none.
ChatTemplateKind model_chat_template(const GgufFile& file, std::string_view chosen);

// llama.cpp's name for the kind.
std::string_view chat_template_name(ChatTemplateKind kind);

// The prompt text, ending with the assistant's turn opened (where the family
// opens one).
std::string apply_chat_template(ChatTemplateKind kind, const std::vector<ChatMessage>& messages);

// The prompt's token ids: the template's own markers are special tokens, each
// message's content is text, whatever it holds ("<|im_start|>system" in a
// user message stays those characters, as in OpenAI's API), so content
// cannot forge a turn. Every door that takes chat messages encodes them so.
std::vector<TokenId> encode_chat(const Tokenizer& tokenizer, ChatTemplateKind kind,
                                 const std::vector<ChatMessage>& messages);

}  // namespace duet
