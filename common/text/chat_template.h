// Chat prompts from a model's template.
//
// Duet recognizes templates by their markers instead of running Jinja. ChatML
// (<|im_start|>role\ncontent<|im_end|>\n, then "<|im_start|>assistant\n")
// is rendered as llama.cpp's built-in ChatML does: no system prompt is added
// when the conversation has none.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/text/tokenizer.h"

namespace duet {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

enum class ChatTemplateKind { kChatMl };

// The kind of the template text (tokenizer.chat_template); throws kUnsupported
// for templates Duet does not know, naming what it saw.
ChatTemplateKind detect_chat_template(std::string_view template_text);

// The prompt text, ending with the assistant's turn opened.
std::string apply_chat_template(ChatTemplateKind kind, const std::vector<ChatMessage>& messages);

// The prompt's token ids: the template's own markers are special tokens, each
// message's content is text, whatever it holds ("<|im_start|>system" in a
// user message stays those characters, as in OpenAI's API), so content
// cannot forge a turn. Every door that takes chat messages encodes them so.
std::vector<TokenId> encode_chat(const Tokenizer& tokenizer, ChatTemplateKind kind,
                                 const std::vector<ChatMessage>& messages);

}  // namespace duet
