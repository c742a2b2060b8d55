#!/usr/bin/env python3
"""Make the tokenizer golden file for SmolLM2 from the llama.cpp reference.

Writes tests/golden/tokenizer_smollm2.json: for ~40 varied texts (English,
contractions, code with tabs/indentation, CJK, emoji with ZWJ sequences and
flags, digits, whitespace runs, URLs, special tokens inside text, the empty
string, a long paragraph) the token ids that llama.cpp produces with

    Llama(model_path, vocab_only=True).tokenize(text.encode('utf-8'),
                                                add_bos=False, special=True)

Reference: llama-cpp-python 0.3.36 (bundled llama.cpp).  The header records the
SHA-256 of the GGUF so a consumer can tell whether the golden matches its model.

Run from anywhere (paths default relative to the repository root):

    python3 tests/golden/make_tokenizer_golden.py \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out tests/golden/tokenizer_smollm2.json]

Deterministic and rerunnable: the same model gives a byte-identical file.
"""
from golden_util import check_unique_names, golden_arguments, repo_path, write_tokenizer_golden

GENERATOR = "tests/golden/make_tokenizer_golden.py"

LONG_PARAGRAPH = (
    "The history of computing is a story of abstraction layered upon abstraction. "
    "Early machines were programmed by physically rewiring circuits; later, stored-program "
    "computers let engineers write instructions as numbers in memory. Assembly languages gave "
    "those numbers mnemonic names, and compilers for FORTRAN (1957) and COBOL (1959) lifted "
    "programmers further away from the hardware. Today, a single line of Python may trigger "
    "millions of machine instructions, executed out of order across dozens of cores, while "
    "caches, branch predictors and speculative execution quietly hide the latency of DRAM. "
    "Yet the fundamentals haven't changed: data moves, arithmetic happens, and results are "
    "written back. Understanding that flow -- from registers to L1, L2, L3 and main memory -- "
    "is still the key to writing fast software in 2024 and beyond."
)

CASES = [
    ("english_simple", "Hello, world!"),
    ("english_sentence", "The quick brown fox jumps over the lazy dog."),
    ("english_two_sentences", "Once upon a time, there was a little girl. She lived in a village near the forest."),
    ("contractions", "don't, I'll, we've, she's, they're, it'd, can't, won't, y'all"),
    ("contractions_upper", "DON'T I'LL WE'VE SHE'S"),
    ("mixed_case", "HeLLo WoRLD, camelCase snake_case SCREAMING_CASE PascalCase iPhone"),
    ("python_code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"),
    ("python_tabs", "class Foo:\n\tdef bar(self, x):\n\t\treturn {'a': [x, x**2]}\n"),
    ("cpp_code", "#include <vector>\n\nint main() {\n    std::vector<int> v{1, 2, 3};\n    for (auto& x : v) { x *= 2; }\n    return 0;\n}\n"),
    ("cpp_template", "template <typename T>\nT max(T a, T b) { return a > b ? a : b; } // comment\n"),
    ("chinese", "你好，世界！今天天气很好，我们去公园散步吧。"),
    ("japanese", "こんにちは、世界。東京は日本の首都です。カタカナもひらがなも。"),
    ("korean", "안녕하세요, 세계! 한국어 토큰화 테스트입니다."),
    ("emoji_simple", "I love pizza 🍕 and cats 🐱!"),
    ("emoji_zwj", "family: 👨‍👩‍👧‍👦 technologist: 👩🏽‍💻 rainbow flag: 🏳️‍🌈"),
    ("emoji_flags", "Flags: 🇫🇷 🇯🇵 🇺🇸 🇩🇪"),
    ("digits_run", "12345"),
    ("digits_pi", "3.14159"),
    ("digits_thousands", "1,000,000"),
    ("digits_mixed", "In 2024, 7 of 10 users paid $19.99 (v1.2.3-rc4) at 10:30am."),
    ("spaces_leading", "   x"),
    ("newlines", "\n\n\n"),
    ("space_tab_mix", "a  \t b"),
    ("trailing_spaces", "trailing spaces   "),
    ("single_space", " "),
    ("many_spaces", "a          b"),
    ("crlf", "line one\r\nline two\r\n"),
    ("url", "See https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1&y=2#readme for details."),
    ("email_path", "mail me at john.doe@example.com or look in /usr/local/lib/libfoo.so.1"),
    ("special_chatml", "<|im_start|>user\nHi<|im_end|>\n"),
    ("special_chatml_full", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    ("special_endoftext", "end of doc<|endoftext|>start of next"),
    ("special_adjacent", "<|im_end|><|im_start|><|endoftext|>"),
    ("special_lookalike", "<|im_start |> <im_end> <|not_a_token|>"),
    ("empty", ""),
    ("punctuation", "Wait... what?! (Really) [yes] {no} <maybe> \"quoted\" 'single' -- em—dash – en"),
    ("accents", "café naïve résumé Zürich façade São Paulo Ελληνικά Русский"),
    ("arabic_hebrew", "مرحبا بالعالم שלום עולם"),
    ("markdown", "# Title\n\n- item one\n- item two\n\n**bold** and `code` and [link](http://a.b)\n"),
    ("json_text", "{\"name\": \"Duet\", \"version\": 1, \"tags\": [\"llm\", \"c++20\"]}"),
    ("long_paragraph", LONG_PARAGRAPH),
]


def main():
    args = golden_arguments(__doc__, "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                            "tests/golden/tokenizer_smollm2.json").parse_args()
    model = repo_path(args.model)

    from llama_cpp import Llama

    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    check_unique_names(CASES)
    cases = []
    for name, text in CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({"name": name, "text": text, "ids": [int(i) for i in ids]})

    write_tokenizer_golden(args.out, GENERATOR, model, llm, {
        "tokenize_call": "Llama(model_path, vocab_only=True).tokenize(text.encode('utf-8'), add_bos=False, special=True)",
    }, cases)


if __name__ == "__main__":
    main()
