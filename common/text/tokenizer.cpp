#include "common/text/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <initializer_list>
#include <queue>

#include "common/error.h"
#include "common/text/spm_tokenizer.h"

namespace duet {

namespace {

// ---------------------------------------------------------------------------
// Pre-tokenizers: the regex lists of llama.cpp's llm_tokenizer_bpe, by the
// name in tokenizer.ggml.pre. Non-ASCII characters are written as \x{...} so
// that no editor can normalize them.

// GPT-2's pattern. llama.cpp drops the final `|\s+`: an unmatched gap becomes
// a piece of its own, which gives the same pieces.
constexpr const char* kGpt2Pattern =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))re";

// Llama 3's pattern, its case-insensitive group spelled out as llama.cpp does.
constexpr const char* kLlama3Pattern =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// Qwen2's: Llama 3's with single digits.
constexpr const char* kQwen2Pattern =
    R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// GPT-4o's, in llama.cpp's form: "[^a-z] that is a letter" stands for the
// upper/title/modifier/other letters, "[^A-Z] that is a letter" for the lower ones.
constexpr const char* kGpt4oPattern =
    R"re([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

constexpr const char* kTekkenPattern =
    R"re([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// CJK ideographs, U+0800..U+4E00 and Hangul, as DeepSeek writes them.
constexpr const char* kDeepseekCjkPattern =
    R"re([\x{4E00}-\x{9FA5}\x{0800}-\x{4E00}\x{AC00}-\x{D7FF}]+)re";

// DeepSeek LLM's letters: the cased letters (Unicode LC) listed range by range.
constexpr const char* kDeepseekLetterPattern =
    R"re(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})re"
    R"re(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386})re"
    R"re(\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F})re"
    R"re(\x{531}-\x{556})re"
    R"re(\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF})re"
    R"re(\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})re"
    R"re(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D})re"
    R"re(\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4})re"
    R"re(\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4})re"
    R"re(\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124})re"
    R"re(\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F})re"
    R"re(\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4})re"
    R"re(\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F})re"
    R"re(\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17})re"
    R"re(\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3})re"
    R"re(\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF})re"
    R"re(\x{1E900}-\x{1E943}]+)re";

// Poro/BLOOM: anything up to whitespace or one of ( | . , ! ? … 。 ， 、 । ۔ ، ).
constexpr const char* kPoroPattern =
    R"re( ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+)re";

struct PreTokenizerDef {
  std::vector<std::string> patterns;
  bool ignore_merges = false;
};

bool name_in(std::string_view name, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::optional<PreTokenizerDef> find_pre_tokenizer(std::string_view name) {
  if (name.empty() || name == "default") {
    return PreTokenizerDef{
        {R"re([\p{P}\$\+<=>\^~\|]+)re", kGpt2Pattern, R"re(\p{N}+)re", "[0-9][0-9][0-9]"}};
  }
  if (name_in(name, {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano"})) {
    return PreTokenizerDef{{kLlama3Pattern}, /*ignore_merges=*/true};
  }
  if (name_in(name, {"dbrx", "smaug-bpe", "glm4", "chatglm-bpe"})) {
    return PreTokenizerDef{{kLlama3Pattern}};
  }
  if (name_in(name, {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2",
                     "hunyuan", "solar-open", "grok-2"})) {
    return PreTokenizerDef{{kQwen2Pattern}};
  }
  if (name == "qwen35") {
    return PreTokenizerDef{
        {R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}};
  }
  if (name_in(name, {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"})) {
    // Every digit alone first, then GPT-2's pattern.
    return PreTokenizerDef{{R"re(\p{N})re", kGpt2Pattern}};
  }
  if (name_in(name,
              {"gpt2",        "gpt-2",           "phi-2",      "jina-es",      "jina-de",
               "gigachat",    "jina-v2-es",      "jina-v2-de", "a.x-4.0",      "mellum",
               "modern-bert", "exaone4",         "mpt",        "olmo",         "jais",
               "trillion",    "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"})) {
    return PreTokenizerDef{{kGpt2Pattern}};
  }
  if (name == "falcon") {
    return PreTokenizerDef{{R"re([\p{P}\$\+<=>\^~\|`]+)re", kGpt2Pattern, "[0-9][0-9][0-9]"}};
  }
  if (name == "deepseek-llm") {
    return PreTokenizerDef{
        {"[\\r\\n]", kDeepseekLetterPattern,
         R"re(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)re",
         R"re(\s+$)re", kDeepseekCjkPattern, R"re(\p{N}+)re"}};
  }
  if (name == "deepseek-coder") {
    return PreTokenizerDef{
        {"[\\r\\n]", R"re(\s?\p{L}+)re", R"re(\s?\p{P}+)re", kDeepseekCjkPattern, R"re(\p{N})re"}};
  }
  if (name_in(name, {"deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"})) {
    return PreTokenizerDef{
        {R"re(\p{N}{1,3})re", R"re([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)re",
         R"re([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"}};
  }
  if (name_in(name, {"poro-chat", "bloom", "gpt3-finnish"})) {
    return PreTokenizerDef{{kPoroPattern}};
  }
  if (name == "viking") {
    return PreTokenizerDef{{kPoroPattern, R"re(\p{N})re"}};
  }
  if (name_in(name, {"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"})) {
    return PreTokenizerDef{{kGpt4oPattern}};
  }
  if (name == "tekken") {
    return PreTokenizerDef{{kTekkenPattern}, /*ignore_merges=*/true};
  }
  if (name == "seed-coder") {
    return PreTokenizerDef{
        {R"re((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+)re"}};
  }
  if (name_in(name, {"bailingmoe", "bailingmoe2", "llada-moe"})) {
    return PreTokenizerDef{
        {R"re('(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)re"}};
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// Tokens llama.cpp recognizes by their text (llama_vocab::impl::load). The
// fullwidth bar is U+FF5C, the low block U+2581.
#define DUET_FW_BAR "\xEF\xBD\x9C"
#define DUET_LOW_BLOCK "\xE2\x96\x81"

constexpr std::string_view kEotTexts[] = {"<|eot_id|>",
                                          "<|im_end|>",
                                          "<|end|>",
                                          "<end_of_turn>",
                                          "<|endoftext|>",
                                          "<|end_of_text|>",
                                          "<EOT>",
                                          "_<EOT>",
                                          "[EOT]",
                                          "<" DUET_FW_BAR "end" DUET_LOW_BLOCK "of" DUET_LOW_BLOCK
                                          "sentence" DUET_FW_BAR ">",
                                          "<end_of_utterance>"};
constexpr std::string_view kEomTexts[] = {"<|eom_id|>"};
constexpr std::string_view kFimPreTexts[] = {
    "<|fim_prefix|>",  "<fim-prefix>",
    "<fim_prefix>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "begin" DUET_FW_BAR ">",
    "<PRE>",           DUET_LOW_BLOCK "<PRE>",
    "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view kFimSufTexts[] = {
    "<|fim_suffix|>",  "<fim-suffix>",
    "<fim_suffix>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "hole" DUET_FW_BAR ">",
    "<SUF>",           DUET_LOW_BLOCK "<SUF>",
    "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view kFimMidTexts[] = {
    "<|fim_middle|>",  "<fim-middle>",
    "<fim_middle>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "end" DUET_FW_BAR ">",
    "<MID>",           DUET_LOW_BLOCK "<MID>",
    "<|code_middle|>", "<|middle|>"};
constexpr std::string_view kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                             "[PAD]"};
constexpr std::string_view kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                             "<REPO>", "<reponame>"};
constexpr std::string_view kFimSepTexts[] = {"<|file_sep|>"};
constexpr std::string_view kEogTexts[] = {"<|eot_id|>",
                                          "<|im_end|>",
                                          "<|end|>",
                                          "<|return|>",
                                          "<|call|>",
                                          "<|flush|>",
                                          "<|calls|>",
                                          "<end_of_turn>",
                                          "<|endoftext|>",
                                          "</s>",
                                          "<|eom_id|>",
                                          "<EOT>",
                                          "_<EOT>",
                                          "[EOT]",
                                          "[EOS]",
                                          "<|end_of_text|>",
                                          "<end_of_utterance>",
                                          "<eos>",
                                          "<turn|>",
                                          "<|tool_response>",
                                          "<" DUET_FW_BAR "end" DUET_LOW_BLOCK "of" DUET_LOW_BLOCK
                                          "sentence" DUET_FW_BAR ">",
                                          "[e~["};
// gpt-oss (harmony) tokens that llama.cpp always renders.
constexpr std::string_view kAlwaysRenderedTexts[] = {"<|channel|>", "<|message|>", "<|start|>",
                                                     "<|constrain|>"};

#undef DUET_FW_BAR
#undef DUET_LOW_BLOCK

template <size_t N>
bool text_in(const std::string& text, const std::string_view (&list)[N]) {
  return std::find(std::begin(list), std::end(list), text) != std::end(list);
}

constexpr int32_t kNoPiece = -1;

uint64_t merge_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

// "<0xAB>" -> 0xAB
std::optional<uint8_t> parse_byte_token(const std::string& text) {
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return std::nullopt;
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(text[3]), lo = hex(text[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

// A byte-level token's bytes; the text itself when a character falls outside
// the byte alphabet (as HF's ByteLevel decoder does).
std::string byte_level_decode(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = utf8_step(text, pos);
    if (step.status != Utf8Status::kComplete) return text;
    const std::optional<uint8_t> byte = bpe_cpt_to_byte(step.cpt);
    if (!byte) return text;
    out.push_back(static_cast<char>(*byte));
    pos += step.length;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction

Tokenizer::Tokenizer(TokenizerSpec spec) : splitter_(std::vector<std::string>{}) {
  if (spec.model == "llama") {
    // llama.cpp reads neither merges nor a pre-tokenizer for SentencePiece.
    model_ = spec.model;
    pre_ = spec.pre.empty() ? "default" : spec.pre;
    sentencepiece_ = true;
    add_space_prefix_ = spec.add_space_prefix;
    validate_and_load(spec);
    if (scores_.empty()) scores_.assign(tokens_.size(), 0.0f);
    build_byte_tokens();
    find_special_tokens();
    build_pieces();
    return;
  }
  if (spec.model != "gpt2") {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("unsupported tokenizer model '{}' (tokenizer.ggml.model: 'gpt2' "
                            "byte-level BPE or 'llama' SentencePiece)",
                            spec.model));
  }
  std::optional<PreTokenizerDef> pre = find_pre_tokenizer(spec.pre);
  if (!pre) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("unsupported pre-tokenizer '{}' (tokenizer.ggml.pre)", spec.pre));
  }
  model_ = spec.model;
  pre_ = spec.pre.empty() ? "default" : spec.pre;
  ignore_merges_ = pre->ignore_merges;
  splitter_ = RegexSplitter(pre->patterns);

  validate_and_load(spec);
  build_merges(spec.merges);
  find_special_tokens();
  build_pieces();
}

void Tokenizer::validate_and_load(TokenizerSpec& spec) {
  const size_t n = spec.tokens.size();
  DUET_REQUIRE(n > 0, "tokenizer has no tokens");
  DUET_REQUIRE(n < size_t(INT32_MAX) / 2, "tokenizer has too many tokens: {}", n);
  DUET_REQUIRE(spec.token_types.empty() || spec.token_types.size() == n,
               "{} token types for {} tokens", spec.token_types.size(), n);
  DUET_REQUIRE(spec.scores.empty() || spec.scores.size() == n, "{} scores for {} tokens",
               spec.scores.size(), n);

  tokens_ = std::move(spec.tokens);
  scores_ = std::move(spec.scores);
  types_.assign(n, TokenType::kNormal);
  for (size_t i = 0; i < spec.token_types.size(); ++i) {
    const auto value = static_cast<int32_t>(spec.token_types[i]);
    // llama.cpp reads values outside the enum as undefined.
    const bool known = value >= 0 && value <= static_cast<int32_t>(TokenType::kByte);
    types_[i] = known ? spec.token_types[i] : TokenType::kUndefined;
  }

  piece_index_.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    // llama.cpp names empty tokens so that every token has a distinct text.
    if (tokens_[i].empty()) tokens_[i] = fmt::format("[EMPTY_{}]", i);
    const auto [it, inserted] = piece_index_.emplace(tokens_[i], static_cast<int32_t>(i));
    DUET_REQUIRE(inserted, "duplicate token '{}' has ids {} and {}", tokens_[i], it->second, i);
  }

  const auto check_id = [n](const std::optional<TokenId>& id, const char* what) {
    DUET_REQUIRE(!id || (*id >= 0 && size_t(*id) < n), "{} id {} is out of range [0, {})", what,
                 id.value_or(-1), n);
  };
  check_id(spec.bos_id, "BOS");
  check_id(spec.eos_id, "EOS");
  check_id(spec.unk_id, "UNK");
  check_id(spec.pad_id, "PAD");
  check_id(spec.eot_id, "EOT");
  check_id(spec.eom_id, "EOM");
  DUET_REQUIRE(!spec.add_bos || spec.bos_id, "add_bos is set but there is no BOS token");
  DUET_REQUIRE(!spec.add_eos || spec.eos_id, "add_eos is set but there is no EOS token");
  bos_id_ = spec.bos_id;
  eos_id_ = spec.eos_id;
  unk_id_ = spec.unk_id;
  pad_id_ = spec.pad_id;
  eot_id_ = spec.eot_id;
  eom_id_ = spec.eom_id;
  add_bos_ = spec.add_bos;
  add_eos_ = spec.add_eos;
}

int32_t Tokenizer::intern_piece(std::string_view text) {
  if (auto it = piece_index_.find(text); it != piece_index_.end()) return it->second;
  const auto id = static_cast<int32_t>(tokens_.size() + extra_pieces_.size());
  extra_pieces_.emplace_back(text);
  piece_index_.emplace(std::string(text), id);
  return id;
}

void Tokenizer::build_merges(const std::vector<std::string>& merges) {
  DUET_REQUIRE(merges.size() < size_t(INT32_MAX), "too many merges: {}", merges.size());
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& merge = merges[rank];
    // As llama.cpp: the first space after the first byte separates the halves.
    const size_t space = merge.find(' ', 1);
    DUET_REQUIRE(space != std::string::npos && space + 1 < merge.size(),
                 "malformed merge at rank {}: '{}' (expected \"left right\")", rank, merge);
    const std::string_view left = std::string_view(merge).substr(0, space);
    const std::string_view right = std::string_view(merge).substr(space + 1);
    joined.assign(left);
    joined.append(right);
    const int32_t left_piece = intern_piece(left);
    const int32_t right_piece = intern_piece(right);
    const int32_t result = intern_piece(joined);
    // A repeated pair keeps its first (best) rank, as llama.cpp's emplace does.
    merges_.try_emplace(merge_key(left_piece, right_piece),
                        Merge{static_cast<int32_t>(rank), result});
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = piece_index_.find(byte_to_bpe_char(static_cast<uint8_t>(b)));
    byte_piece_[b] = it != piece_index_.end() ? it->second : kNoPiece;
  }
  build_byte_tokens();
}

void Tokenizer::build_byte_tokens() {
  for (int b = 0; b < 256; ++b) {
    single_byte_token_[b] = find_token(std::string(1, static_cast<char>(b))).value_or(-1);
    // As llama.cpp's byte_to_token: upper-case hex first, then the byte itself.
    byte_token_[b] = find_token(fmt::format("<0x{:02X}>", b)).value_or(single_byte_token_[b]);
  }
}

// llama.cpp decides a token's role partly by its text: the end-of-turn,
// end-of-message and FIM tokens it finds by name are promoted to control
// tokens, and the end-of-generation set is built from names plus eos/eot/eom.
void Tokenizer::find_special_tokens() {
  const auto n = static_cast<TokenId>(tokens_.size());
  const auto promote = [this](TokenId id) { types_[id] = TokenType::kControl; };
  // The first token (lowest id) whose text is in `list`, promoted to control.
  const auto detect = [&](const auto& list) -> std::optional<TokenId> {
    for (TokenId id = 0; id < n; ++id) {
      if (text_in(tokens_[id], list)) {
        promote(id);
        return id;
      }
    }
    return std::nullopt;
  };
  if (!eot_id_) eot_id_ = detect(kEotTexts);
  if (!eom_id_) eom_id_ = detect(kEomTexts);
  detect(kFimPreTexts);
  detect(kFimSufTexts);
  detect(kFimMidTexts);
  const std::optional<TokenId> fim_pad = detect(kFimPadTexts);
  const std::optional<TokenId> fim_rep = detect(kFimRepTexts);
  const std::optional<TokenId> fim_sep = detect(kFimSepTexts);

  std::vector<bool> eog(n, false);
  for (const auto& id : {fim_pad, fim_rep, fim_sep, eos_id_, eot_id_, eom_id_}) {
    if (id) eog[*id] = true;
  }
  for (TokenId id = 0; id < n; ++id) {
    if (text_in(tokens_[id], kEogTexts)) {
      eog[id] = true;
      promote(id);
    }
    if (text_in(tokens_[id], kAlwaysRenderedTexts)) types_[id] = TokenType::kUserDefined;
  }
  // o200k_harmony / solar-open: with <|return|> and <|call|> (or <|calls|> and
  // <|flush|>) present, <|end|> only ends a message, not the generation.
  const auto eog_has = [&](std::string_view text) {
    const std::optional<TokenId> id = find_token(text);
    return id && eog[*id];
  };
  if (eog_has("<|end|>") && ((eog_has("<|return|>") && eog_has("<|call|>")) ||
                             (eog_has("<|calls|>") && eog_has("<|flush|>")))) {
    const TokenId end = *find_token("<|end|>");
    eog[end] = false;
    types_[end] = TokenType::kUserDefined;
  }
  // Gemma 4 / PaddleOCR: </s> is a plain token when <|tool_response> exists.
  if (eog_has("<|tool_response>") && eog_has("</s>")) {
    const TokenId s = *find_token("</s>");
    eog[s] = false;
    types_[s] = TokenType::kNormal;
  }
  for (TokenId id = 0; id < n; ++id) {
    if (eog[id]) eog_ids_.push_back(id);
  }

  for (TokenId id = 0; id < n; ++id) {
    const TokenType type = types_[id];
    if (type == TokenType::kControl || type == TokenType::kUserDefined ||
        type == TokenType::kUnknown) {
      special_tokens_.push_back(id);
    }
  }
  // Longest first, so that a token is never split out of a longer one.
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(),
                   [this](TokenId a, TokenId b) { return tokens_[a].size() > tokens_[b].size(); });
}

void Tokenizer::build_pieces() {
  pieces_.resize(tokens_.size());
  for (size_t id = 0; id < tokens_.size(); ++id) {
    const std::string& text = tokens_[id];
    switch (types_[id]) {
      case TokenType::kNormal:
        pieces_[id] = sentencepiece_ ? spm_unescape_whitespace(text) : byte_level_decode(text);
        break;
      case TokenType::kControl:
      case TokenType::kUnknown:
      case TokenType::kUserDefined:
        pieces_[id] = text;
        break;
      case TokenType::kByte: {
        const std::optional<uint8_t> byte = parse_byte_token(text);
        pieces_[id] = byte ? std::string(1, static_cast<char>(*byte)) : text;
        break;
      }
      case TokenType::kUnused:
      case TokenType::kUndefined:
        break;  // llama.cpp renders these as nothing
    }
  }
}

// ---------------------------------------------------------------------------
// Encoding

struct Tokenizer::BpeScratch {
  struct Symbol {
    int32_t piece;  // kNoPiece: a text that no token or merge knows
    int32_t prev, next;
    uint32_t begin, end;  // byte range of the word; begin == end once merged away
  };
  struct Bigram {
    int32_t rank;
    int32_t left, right;  // symbol indices
    int32_t left_piece, right_piece;
    int32_t result;
  };
  struct WorseBigram {  // lowest rank first, then leftmost (llama.cpp's order)
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
  };
  std::vector<Symbol> symbols;
  std::vector<Bigram> heap;
  std::string text;
};

void Tokenizer::encode_word(std::string_view word, BpeScratch& scratch,
                            std::vector<TokenId>& out) const {
  const auto n_tokens = static_cast<int32_t>(tokens_.size());
  if (ignore_merges_) {
    scratch.text.clear();
    for (char c : word) scratch.text.append(byte_to_bpe_char(static_cast<uint8_t>(c)));
    if (auto it = piece_index_.find(std::string_view(scratch.text));
        it != piece_index_.end() && it->second < n_tokens) {
      out.push_back(it->second);
      return;
    }
  }

  auto& symbols = scratch.symbols;
  symbols.clear();
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols.push_back({byte_piece_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1,
                       uint32_t(i), uint32_t(i + 1)});
  }

  auto& heap = scratch.heap;
  heap.clear();
  const BpeScratch::WorseBigram worse;
  const auto add_bigram = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t left_piece = symbols[left].piece, right_piece = symbols[right].piece;
    if (left_piece == kNoPiece || right_piece == kNoPiece) return;
    const auto it = merges_.find(merge_key(left_piece, right_piece));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, left, right, left_piece, right_piece, it->second.result});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (int32_t i = 1; i < n; ++i) add_bigram(i - 1, i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const BpeScratch::Bigram bigram = heap.back();
    heap.pop_back();
    auto& left = symbols[bigram.left];
    auto& right = symbols[bigram.right];
    // Stale: one side was merged since this pair was queued.
    if (left.begin == left.end || right.begin == right.end || left.piece != bigram.left_piece ||
        right.piece != bigram.right_piece) {
      continue;
    }
    left.piece = bigram.result;
    left.end = right.end;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    right.begin = right.end;
    add_bigram(left.prev, bigram.left);
    add_bigram(bigram.left, left.next);
  }

  for (int32_t i = 0; i >= 0 && i < n; i = symbols[i].next) {
    const auto& symbol = symbols[i];
    if (symbol.piece >= 0 && symbol.piece < n_tokens) {
      out.push_back(symbol.piece);
      continue;
    }
    // Not a token: llama.cpp falls back to the tokens of the single bytes of
    // the symbol's byte-level text, and drops bytes that have none.
    for (uint32_t k = symbol.begin; k < symbol.end; ++k) {
      for (char c : byte_to_bpe_char(static_cast<uint8_t>(word[k]))) {
        const TokenId id = single_byte_token_[static_cast<uint8_t>(c)];
        if (id >= 0) out.push_back(id);
      }
    }
  }
}

std::vector<Tokenizer::Fragment> Tokenizer::split_special(std::string_view text,
                                                          bool parse_special) const {
  // Token by token, longest first, every occurrence in every remaining text
  // fragment becomes a token fragment.
  std::vector<Fragment> fragments;
  if (!text.empty()) fragments.push_back({-1, 0, text.size()});
  std::vector<Fragment> next;
  for (const TokenId special : special_tokens_) {
    if (!parse_special && types_[special] != TokenType::kUserDefined) continue;
    const std::string& needle = tokens_[special];
    if (text.find(needle) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& fragment : fragments) {
      if (fragment.token >= 0) {
        next.push_back(fragment);
        continue;
      }
      const std::string_view scope = text.substr(0, fragment.end);
      size_t pos = fragment.begin;
      for (size_t match = scope.find(needle, pos); match != std::string_view::npos;
           match = scope.find(needle, pos)) {
        if (match > pos) next.push_back({-1, pos, match});
        next.push_back({special, match, match + needle.size()});
        pos = match + needle.size();
      }
      if (pos < fragment.end) next.push_back({-1, pos, fragment.end});
    }
    fragments.swap(next);
  }
  return fragments;
}

void Tokenizer::encode_bpe(std::string_view text, const std::vector<Fragment>& fragments,
                           std::vector<TokenId>& out) const {
  BpeScratch scratch;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
      continue;
    }
    const std::string normalized =
        utf8_normalize_lenient(text.substr(fragment.begin, fragment.end - fragment.begin));
    for (std::string_view word : splitter_.split(normalized)) encode_word(word, scratch, out);
  }
}

void Tokenizer::encode_spm(std::string_view text, const std::vector<Fragment>& fragments,
                           std::vector<TokenId>& out) const {
  const SpmVocab vocab{
      [this](std::string_view piece) { return find_token(piece).value_or(-1); },
      scores_,
      byte_token_,
      unk_id_.value_or(-1),
  };
  // As llama.cpp: a text fragment at the start or right after a special token
  // gets the leading space, whether or not BOS was added.
  bool after_special = true;
  std::string fragment_text;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
      after_special = true;
      continue;
    }
    fragment_text.clear();
    if (add_space_prefix_ && after_special) fragment_text.push_back(' ');
    fragment_text.append(text.substr(fragment.begin, fragment.end - fragment.begin));
    spm_tokenize(spm_escape_whitespace(fragment_text), vocab, out);
    after_special = false;
  }
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(*bos_id_);
  // Special tokens come out of the text first (llama.cpp's tokenizer_st_partition).
  const std::vector<Fragment> fragments = split_special(text, parse_special);
  if (sentencepiece_) {
    encode_spm(text, fragments, out);
  } else {
    encode_bpe(text, fragments, out);
  }
  if (add_special && add_eos_) out.push_back(*eos_id_);
  return out;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  if (sentencepiece_) {  // no pre-tokenizer: one piece
    if (text.empty()) return {};
    return {std::string(text)};
  }
  const std::string normalized = utf8_normalize_lenient(text);
  std::vector<std::string> words;
  for (std::string_view word : splitter_.split(normalized)) words.emplace_back(word);
  return words;
}

// ---------------------------------------------------------------------------
// Decoding and lookups

bool Tokenizer::is_special_type(TokenId id) const {
  return types_[id] == TokenType::kControl || types_[id] == TokenType::kUnknown;
}

bool Tokenizer::strips_space_after_bos(std::span<const TokenId> ids) const {
  return sentencepiece_ && add_space_prefix_ && bos_id_ && !ids.empty() && ids.front() == *bos_id_;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  std::string out;
  bool strip_space = strips_space_after_bos(ids);
  for (const TokenId id : ids) {
    DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
                 tokens_.size());
    if (skip_special && is_special_type(id)) continue;
    std::string_view piece = pieces_[id];
    // Only a space that starts the decoded text is dropped.
    if (strip_space && !piece.empty()) {
      if (piece.front() == ' ') piece.remove_prefix(1);
      strip_space = false;
    }
    out += piece;
  }
  return out;
}

std::string Tokenizer::token_to_piece(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return pieces_[id];
}

const std::string& Tokenizer::token_text(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return tokens_[id];
}

TokenType Tokenizer::token_type(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return types_[id];
}

std::optional<TokenId> Tokenizer::find_token(std::string_view text) const {
  const auto it = piece_index_.find(text);
  if (it == piece_index_.end() || size_t(it->second) >= tokens_.size()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_end_of_generation(TokenId id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

// ---------------------------------------------------------------------------
// Streaming

std::string IncrementalDecoder::push(TokenId id) {
  const Tokenizer& tokenizer = *tokenizer_;
  DUET_REQUIRE(id >= 0 && size_t(id) < tokenizer.vocab_size(),
               "token id {} is out of range [0, {})", id, tokenizer.vocab_size());
  if (leading_space_ == LeadingSpace::kUndecided) {
    leading_space_ = tokenizer.strips_space_after_bos(std::span<const TokenId>(&id, 1))
                         ? LeadingSpace::kStrip
                         : LeadingSpace::kKeep;
  }
  if (skip_special_ && tokenizer.is_special_type(id)) return {};
  std::string_view piece = tokenizer.pieces_[id];
  if (leading_space_ == LeadingSpace::kStrip && !piece.empty()) {  // as Tokenizer::decode
    if (piece.front() == ' ') piece.remove_prefix(1);
    leading_space_ = LeadingSpace::kKeep;
  }
  pending_ += piece;

  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const Utf8Step step = utf8_step(pending_, pos);
    if (step.status == Utf8Status::kIncomplete) break;  // only ever the tail: wait for more
    if (step.status == Utf8Status::kComplete) {
      out.append(pending_, pos, step.length);
    } else {
      utf8_append(out, kReplacementChar);
    }
    pos += step.length;
  }
  pending_.erase(0, pos);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out = utf8_sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace duet
