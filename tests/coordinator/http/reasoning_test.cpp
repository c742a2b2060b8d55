// A reply's <think> block as reasoning_content: the splitter's rule on whole
// replies, its independence from how a stream cuts the text, and the chat
// responses (whole and streamed) that carry it.
#include "coordinator/http/reasoning.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "coordinator/http/openai_api.h"

namespace duet::openai {
namespace {

ReasoningSplitter::Parts whole(std::string_view text) {
  ReasoningSplitter s;
  ReasoningSplitter::Parts parts = s.add(text);
  ReasoningSplitter::Parts rest = s.finish();
  return {parts.reasoning + rest.reasoning, parts.content + rest.content};
}

// The text fed in pieces cut at `cuts` (sorted offsets).
ReasoningSplitter::Parts in_pieces(std::string_view text, const std::vector<size_t>& cuts) {
  ReasoningSplitter s;
  ReasoningSplitter::Parts out;
  size_t at = 0;
  for (size_t cut : cuts) {
    const ReasoningSplitter::Parts p = s.add(text.substr(at, cut - at));
    out.reasoning += p.reasoning;
    out.content += p.content;
    at = cut;
  }
  for (const ReasoningSplitter::Parts& p : {s.add(text.substr(at)), s.finish()}) {
    out.reasoning += p.reasoning;
    out.content += p.content;
  }
  return out;
}

struct Case {
  std::string text, reasoning, content;
};

const std::vector<Case> kCases = {
    {"<think>\nLet me add.\n</think>\n\n2 + 2 = 4.", "Let me add.", "2 + 2 = 4."},
    {"<think></think>Hi", "", "Hi"},
    {"<think>\n\n</think>\n\nHi there ", "", "Hi there "},  // Qwen3's empty thinking
    {"<think> a </think b </think> c", "a </think b", "c"},
    {"<think>\nstill thinking\n", "still thinking", ""},  // cut off: all reasoning
    {"<think>", "", ""},
    {"<thin", "", "<thin"},  // not a tag after all
    {"<thinking>x</think>y", "", "<thinking>x</think>y"},
    {" <think>x</think>y", "", " <think>x</think>y"},  // only at the very start
    {"Plain answer </think>", "", "Plain answer </think>"},
    {"<think>a\n</thi", "a\n</thi", ""},
    {"<think>é ü\t</think>\t\tß", "é ü", "ß"},
    {"", "", ""},
};

TEST(ReasoningSplitter, WholeReplies) {
  for (const Case& c : kCases) {
    const ReasoningSplitter::Parts p = whole(c.text);
    EXPECT_EQ(p.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(p.content, c.content) << c.text;
  }
}

TEST(ReasoningSplitter, AnyCutsGiveTheWholeReplysParts) {
  std::mt19937 rng(5);
  for (const Case& c : kCases) {
    // Every single cut, then random sets of cuts (bytes one at a time included).
    for (size_t cut = 0; cut <= c.text.size(); ++cut) {
      const ReasoningSplitter::Parts p = in_pieces(c.text, {cut});
      EXPECT_EQ(p.reasoning, c.reasoning) << c.text << " cut at " << cut;
      EXPECT_EQ(p.content, c.content) << c.text << " cut at " << cut;
    }
    std::vector<size_t> every(c.text.size());
    for (size_t i = 0; i < every.size(); ++i) every[i] = i;
    const ReasoningSplitter::Parts bytes = in_pieces(c.text, every);
    EXPECT_EQ(bytes.reasoning, c.reasoning) << c.text;
    EXPECT_EQ(bytes.content, c.content) << c.text;
    for (int trial = 0; trial < 20 && !c.text.empty(); ++trial) {
      std::vector<size_t> cuts;
      for (size_t i = 0; i < c.text.size(); ++i) {
        if (rng() % 3 == 0) cuts.push_back(i);
      }
      const ReasoningSplitter::Parts p = in_pieces(c.text, cuts);
      EXPECT_EQ(p.reasoning, c.reasoning) << c.text;
      EXPECT_EQ(p.content, c.content) << c.text;
    }
  }
}

TEST(ReasoningSplitter, ReasoningStreamsBeforeTheReplyEnds) {
  ReasoningSplitter s;
  EXPECT_EQ(s.add("<think>\n").reasoning, "");
  EXPECT_EQ(s.add("Step one. ").reasoning, "Step one.");  // the space waits for more
  EXPECT_EQ(s.add("Step two.\n</").reasoning, " Step two.");
  const ReasoningSplitter::Parts end = s.add("think>\n\nDone");
  EXPECT_EQ(end.reasoning, "");
  EXPECT_EQ(end.content, "Done");
}

CompletionRequest chat_request(bool stream) {
  CompletionRequest r;
  r.endpoint = Endpoint::kChatCompletions;
  r.stream = stream;
  return r;
}

RequestUpdate update(std::string text, bool finished) {
  RequestUpdate u;
  u.text = std::move(text);
  u.finished = finished;
  return u;
}

TEST(ReasoningResponses, WholeChatReplyCarriesReasoningContent) {
  const std::vector<std::string> pieces = {"<think>\nHm", "m.\n</think>", "\n\nYes."};
  ResponseWriter split(chat_request(false), "chatcmpl-1", 0, "m", true);
  ResponseWriter raw(chat_request(false), "chatcmpl-2", 0, "m", false);
  for (size_t i = 0; i < pieces.size(); ++i) {
    split.collect(update(pieces[i], i + 1 == pieces.size()));
    raw.collect(update(pieces[i], i + 1 == pieces.size()));
  }
  const auto message =
      nlohmann::json::parse(split.full_response(update("", true)))["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "Hmm.");
  EXPECT_EQ(message["content"], "Yes.");
  const auto plain =
      nlohmann::json::parse(raw.full_response(update("", true)))["choices"][0]["message"];
  EXPECT_FALSE(plain.contains("reasoning_content"));
  EXPECT_EQ(plain["content"], "<think>\nHmm.\n</think>\n\nYes.");

  // Completions keep the raw text whatever the server's setting.
  CompletionRequest completion;
  ResponseWriter text(completion, "cmpl-1", 0, "m", true);
  text.collect(update("<think>x</think>y", true));
  EXPECT_EQ(nlohmann::json::parse(text.full_response(update("", true)))["choices"][0]["text"],
            "<think>x</think>y");
}

TEST(ReasoningResponses, StreamedDeltasAddUpToTheWholeReply) {
  const std::vector<std::string> pieces = {"<think>", "\nHm", "m.\n</", "think>\n\n", "Ye", "s."};
  ResponseWriter writer(chat_request(true), "chatcmpl-1", 0, "m", true);
  std::string events = writer.stream_start();
  for (size_t i = 0; i < pieces.size(); ++i) {
    events += writer.stream_update(update(pieces[i], i + 1 == pieces.size()));
  }
  std::string reasoning, content;
  size_t at = 0;
  while ((at = events.find("data: {", at)) != std::string::npos) {
    const size_t end = events.find("\n\n", at);
    const auto chunk = nlohmann::json::parse(events.substr(at + 6, end - at - 6));
    const auto& delta = chunk["choices"][0]["delta"];
    if (delta.contains("reasoning_content")) reasoning += delta["reasoning_content"];
    if (delta.contains("content")) content += delta["content"];
    at = end;
  }
  EXPECT_EQ(reasoning, "Hmm.");
  EXPECT_EQ(content, "Yes.");
  EXPECT_NE(events.find("data: [DONE]"), std::string::npos);
}

}  // namespace
}  // namespace duet::openai
