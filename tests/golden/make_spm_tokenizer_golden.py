#!/usr/bin/env python3
"""Make the SentencePiece tokenizer golden file for stories260K from the llama.cpp reference.

Writes tests/golden/tokenizer_stories260k.json: for ~40 varied texts (English,
leading/trailing/repeated spaces, newlines and tabs, digits, punctuation,
characters outside the 512-token vocabulary that need byte fallback (CJK,
emoji, accents), the empty string, special-token text such as "<s>" and "</s>",
text that already holds U+2581) what llama.cpp produces for the
SentencePiece-style ("llama") vocabulary of stories260K.gguf:

    ids          = llm.tokenize(text.encode('utf-8'), add_bos=True, special=True)
    ids_unparsed = llm.tokenize(text.encode('utf-8'), add_bos=True, special=False)
    detokenized          = llm.detokenize(ids)                # special=False
    detokenized_special  = llm.detokenize(ids, special=True)

with llm = Llama(model_path, vocab_only=True). The model adds BOS
(tokenizer.ggml.add_bos_token), so every ids list starts with it.

llama-cpp-python's detokenize concatenates llama_token_to_piece (lstrip 0) and
then drops one leading space when the first id is BOS: "Once upon a time"
round-trips. llama.cpp's C llama_detokenize differs there (with
remove_special=False it strips the first token's leading space only when the
first token is *not* BOS, so [BOS, ...] decodes to " Once upon a time"); the
golden follows llama-cpp-python, as Duet's Tokenizer::decode does.

Reference: llama-cpp-python 0.3.36 (bundled llama.cpp). The header records the
SHA-256 of the GGUF so a consumer can tell whether the golden matches its model.
The model is never copied into the repository.

Run from anywhere (paths default relative to the repository root):

    python3 tests/golden/make_spm_tokenizer_golden.py \\
        [--model ../shared/models/stories260K.gguf] \\
        [--out tests/golden/tokenizer_stories260k.json]

Deterministic and rerunnable: the same model gives a byte-identical file.
"""
from golden_util import check_unique_names, golden_arguments, repo_path, write_tokenizer_golden

GENERATOR = "tests/golden/make_spm_tokenizer_golden.py"

LONG_STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball under a tree. She ran to the ball and picked it up. "
    "\"This is my ball now!\" she said. But then a small boy came and started to cry. Lily felt "
    "sad and gave the ball back to him. The boy smiled and said, \"Thank you, Lily!\" They "
    "played together all day and became best friends. The end."
)

CASES = [
    ("english_simple", "Hello, world!"),
    ("once_upon_a_time", "Once upon a time"),
    ("story_sentence", "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."),
    ("dialog_quotes", "Tom said, \"I want to play with the ball!\" Mom smiled."),
    ("contractions", "don't, I'll, we've, she's, it's, can't"),
    ("mixed_case", "HeLLo WoRLD camelCase iPhone SCREAMING"),
    ("single_char", "a"),
    ("common_word", "the"),
    ("leading_space", " leading space"),
    ("leading_spaces", "   three leading"),
    ("trailing_spaces", "trailing   "),
    ("multiple_spaces", "a    b     c"),
    ("single_space", " "),
    ("two_spaces", "  "),
    ("newline", "line one\nline two"),
    ("newlines_only", "\n\n\n"),
    ("tabs_crlf", "a\tb\r\nc\t\td"),
    ("digits_run", "12345"),
    ("digits_mixed", "In 2024, 7 of 10 cats ate 3.5 fish at 10:30."),
    ("punctuation", "Wait... what?! (Really) [yes] {no} <maybe> -- ~ | \\ % # @ & * ^ `"),
    ("chinese", "你好，世界！"),
    ("japanese", "こんにちは、東京。"),
    ("emoji", "I love pizza 🍕 and cats 🐱!"),
    ("emoji_zwj", "family: 👨‍👩‍👧"),
    ("accents", "café naïve résumé Zürich"),
    ("cyrillic", "Привет мир"),
    ("arabic", "مرحبا بالعالم"),
    ("vocab_symbols", "™ € â a\u200ab"),
    ("empty", ""),
    ("special_bos_text", "<s>"),
    ("special_eos_text", "</s>"),
    ("special_unk_text", "<unk>"),
    ("special_inside", "Hello</s>world"),
    ("special_around", "<s>Once upon a time</s>"),
    ("special_space_after", "The end.</s> The next story"),
    ("special_adjacent", "<s></s><s>"),
    ("special_lookalike", "<s > </ s> <S> <|endoftext|>"),
    ("byte_token_text", "<0x0A> <0xFF>"),
    ("low_block_text", "\u2581 already \u2581\u2581escaped"),
    ("code", "def f(x):\n    return x * 2\n"),
    ("url", "See https://example.com/a?b=c&d=1#top for more."),
    ("long_story", LONG_STORY),
]


def main():
    args = golden_arguments(__doc__, "../shared/models/stories260K.gguf",
                            "tests/golden/tokenizer_stories260k.json").parse_args()
    model = repo_path(args.model)

    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    assert llama_cpp.llama_vocab_get_add_bos(vocab), "stories260K adds BOS"
    bos = int(llama_cpp.llama_vocab_bos(vocab))

    check_unique_names(CASES)
    cases = []
    for name, text in CASES:
        data = text.encode("utf-8")
        ids = [int(i) for i in llm.tokenize(data, add_bos=True, special=True)]
        ids_unparsed = [int(i) for i in llm.tokenize(data, add_bos=True, special=False)]
        assert ids[0] == bos and ids_unparsed[0] == bos, name
        cases.append({
            "name": name,
            "text": text,
            "ids": ids,
            "ids_unparsed": ids_unparsed,
            "detokenized": llm.detokenize(ids).decode("utf-8"),
            "detokenized_special": llm.detokenize(ids, special=True).decode("utf-8"),
        })

    write_tokenizer_golden(args.out, GENERATOR, model, llm, {
        "tokenize_call": "Llama(model_path, vocab_only=True).tokenize(text.encode('utf-8'), add_bos=True, special=True)",
        "tokenize_unparsed_call": "Llama(model_path, vocab_only=True).tokenize(text.encode('utf-8'), add_bos=True, special=False)",
        "detokenize_call": "Llama(model_path, vocab_only=True).detokenize(ids) and .detokenize(ids, special=True)",
        "add_bos": True,
        "bos_id": bos,
    }, cases)


if __name__ == "__main__":
    main()
