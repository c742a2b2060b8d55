// Chat templates against llama.cpp's built-in renderer
// (tests/golden/make_chat_template_golden.py): every family Duet takes
// detected from its markers and rendered byte for byte as llama.cpp renders
// it, every other template refused by name, and the names `--chat-template`
// takes.
#include "common/text/chat_template.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

nlohmann::json golden() {
  return testing::read_golden(testing::fixture_path("golden/chat_templates.json"));
}

std::vector<ChatMessage> messages_of(const nlohmann::json& conversation) {
  std::vector<ChatMessage> messages;
  for (const auto& m : conversation["messages"]) messages.push_back({m["role"], m["content"]});
  return messages;
}

TEST(ChatTemplates, RenderAsLlamaCppOrAreRefused) {
  const nlohmann::json g = golden();
  int rendered = 0, refused = 0;
  for (const auto& t : g["templates"]) {
    const std::string name = t["name"];
    const std::string text = t["template"];
    SCOPED_TRACE(name);
    if (t["duet"] == "refuse") {
      try {
        detect_chat_template(text);
        ADD_FAILURE() << "took a template llama.cpp renders as another family";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
        EXPECT_NE(std::string(e.what()).find("unsupported chat template"), std::string::npos);
      }
      ++refused;
      continue;
    }
    const ChatTemplateKind kind = detect_chat_template(text);
    if (name != "qwen3") {
      EXPECT_EQ(chat_template_name(kind), name);
    }
    for (const auto& conversation : g["conversations"]) {
      const std::string label = conversation["name"];
      EXPECT_EQ(apply_chat_template(kind, messages_of(conversation)),
                t["llama_cpp"][label].get<std::string>())
          << label;
    }
    ++rendered;
  }
  EXPECT_EQ(rendered, 8);
  EXPECT_EQ(refused, 3);
}

TEST(ChatTemplates, NamesPickTheirKind) {
  for (const char* name : {"chatml", "llama3", "gemma", "mistral-v1", "mistral-v3",
                           "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken"}) {
    EXPECT_EQ(chat_template_name(detect_chat_template(name)), name);
  }
  // v7-tekken: no trailing spaces after the markers.
  const std::vector<ChatMessage> turn = {{"system", "s"}, {"user", "u"}, {"assistant", "a"}};
  EXPECT_EQ(apply_chat_template(ChatTemplateKind::kMistralV7Tekken, turn),
            "[SYSTEM_PROMPT]s[/SYSTEM_PROMPT][INST]u[/INST]a</s>");
  EXPECT_THROW(detect_chat_template("llama2"), Error);
}

TEST(ChatTemplates, UnknownRolesAreRefused) {
  for (const char* name : {"chatml", "llama3", "gemma", "mistral-v7"}) {
    EXPECT_THROW(apply_chat_template(detect_chat_template(name), {{"tool", "x"}}), Error) << name;
  }
}

}  // namespace
}  // namespace duet
