#!/usr/bin/env python3
"""Writes the text seeds of tests/fuzz/corpus/tokenizer/ (the fuzzer starts from these).

Short texts that reach the tokenizer's distinct paths: each pre-tokenizer regex class (letters,
digits, punctuation, whitespace runs, contractions), multi-byte UTF-8 of every length, ChatML and
other special tokens of the default model (SmolLM2), and invalid UTF-8 (stray continuation bytes,
truncated sequences, overlong forms, surrogates, bytes above U+10FFFF).

Usage: python3 tests/fuzz/make_tokenizer_seeds.py [OUT_DIR]   (default: tests/fuzz/corpus/tokenizer)
"""
from __future__ import annotations

import sys
from pathlib import Path

SEEDS: dict[str, bytes] = {
    # English and contractions
    "english.txt": b"The quick brown fox jumps over the lazy dog.",
    "contractions.txt": b"I'm sure you're right, it's what we'd've done; they'll see. DON'T",
    "sentence_newlines.txt": b"Hello world!\nHow are you?\n\nFine, thanks.\n",
    "capitals_mixed.txt": b"HTTPServer parseJSON XMLHttpRequest iPhone McDonald's",
    # Code
    "code_python.txt": b"def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "code_cpp.txt": b"int main() {\n\tstd::vector<int> v{1, 2, 3};\n\treturn v[0] != 1;\n}\n",
    "code_json.txt": b'{"role": "user", "content": "hi", "n": [1, 2.5e-3, null, true]}',
    "url_path.txt": b"https://example.com/a/b?c=d&e=%20f#g /usr/local/bin/../lib",
    # Digits
    "digits.txt": b"0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-01-31",
    "digits_long.txt": b"31415926535897932384626433832795028841971693993751",
    # Whitespace
    "whitespace_runs.txt": b"a  b   c    d\t\te\r\nf \n \n   \t  ",
    "only_spaces.txt": b"                ",
    "newlines_only.txt": b"\n\n\n\r\n\r\r\n",
    "leading_trailing_space.txt": b"   padded text   ",
    # Non-ASCII
    "chinese.txt": "你好，世界！今天天气很好。我们去公园吧。".encode(),
    "japanese_korean.txt": "こんにちは、カタカナ。안녕하세요 세계".encode(),
    "accents.txt": "Café naïve façade Ångström Straße œuvre ½ ² ﬁ".encode(),
    "cyrillic_greek_arabic.txt": "Привет мир Γειά σου κόσμε مرحبا بالعالم".encode(),
    "emoji.txt": "I ❤️ 🦀 and 🐍! 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽".encode(),
    "combining_marks.txt": "e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937 Z\u0351\u0352\u0353".encode(),
    "math_symbols.txt": "∀x∈ℝ: x²≥0 ⇒ √(x²)=|x| ∑∫∂ ≠ ≤ ∞".encode(),
    "special_spaces.txt": "a\u00a0b\u2003c\u3000d\u200be\ufeff".encode(),
    # Special tokens of SmolLM2 (ChatML and StarCoder-style), whole, adjacent and broken
    "chatml.txt": b"<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                  b"<|im_start|>assistant\n",
    "special_adjacent.txt": b"<|endoftext|><|endoftext|>x<|im_end|><|im_start|>",
    "special_broken.txt": b"<|im_start <|im_end| <|endoftext|> <im_start> |>",
    "starcoder_tokens.txt": b"<repo_name>duet<file_sep><filename>a.py<gh_stars>10<jupyter_code>",
    # Invalid UTF-8
    "invalid_continuation.txt": b"abc\x80\xbfdef\x80",
    "invalid_truncated.txt": b"x\xe4\xb8 y\xf0\x9f\x98 z\xc3",
    "invalid_overlong_surrogate.txt": b"\xc0\xaf \xe0\x80\xaf \xed\xa0\x80\xed\xbf\xbf \xc1\x81",
    "invalid_high_bytes.txt": b"\xf4\x90\x80\x80 \xf5\x80\x80\x80 \xf8\x88\x80\x80\x80 \xfe\xff",
    "invalid_mixed_special.txt": b"\xe4<|im_start|>\xb8\xad<|im_end|>\x80",
    "nul_and_controls.txt": b"a\x00b\x01\x02\x1b[31mred\x1b[0m\x7f",
    # Valid UTF-8 with bytes SmolLM2 has no byte-level token for (encode drops them, as llama.cpp
    # does): U+0004, U+0006, U+0013, U+0014, U+0016, U+001D, and U+40000 / U+80000 (lead bytes
    # F1 and F2). The first fuzz run found the round trip failing on such a byte (0x06).
    "bytes_without_tokens.txt": b"a\x04b\x06c\x13\x14\x16\x1dd \xf1\x80\x80\x80 \xf2\x80\x80\x80e",
}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus" / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in SEEDS.items():
        (out / name).write_bytes(data)
    print(f"{len(SEEDS)} seeds in {out}")


if __name__ == "__main__":
    main()
