#include "common/text/pre_tokenizers.h"

#include <algorithm>
#include <initializer_list>

namespace duet {
namespace {

// Non-ASCII characters are written as \x{...} so that no editor can
// normalize them.

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

bool name_in(std::string_view name, std::initializer_list<std::string_view> names) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

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

}  // namespace duet
