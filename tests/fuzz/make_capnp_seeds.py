#!/usr/bin/env python3
"""Writes the seed messages of tests/fuzz/corpus/capnp_request/ (the fuzzer starts from these).

Each file is one GenerateRequest of common/duet.capnp as the RPC front receives it: an unpacked
Cap'n Proto message (segment table, then the segments), written with pycapnp. They cover the
three prompt forms, every sampling field, stop strings, the flags and the model name, plus edge
values the converter must pass through unchanged (maxTokens 0 and 2^32 - 1, NaN and infinite
floats, negative token ids and top_k, text that is not UTF-8 or holds a NUL), and one message of
several segments (a far pointer), so that the fuzzer mutates from valid structure.

Usage: python3 tests/fuzz/make_capnp_seeds.py [OUT_DIR]   (default: tests/fuzz/corpus/capnp_request)
Needs pycapnp (the project's Python environment has it).
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import capnp

ROOT = Path(__file__).resolve().parents[2]
# Not UTF-8: a truncated sequence, a lone continuation byte, an overlong "/", a surrogate.
BAD_UTF8 = b"caf\xc3 \x80 \xc0\xaf \xed\xa0\x80"


def load_schema():
    capnp.remove_import_hook()
    # duet.capnp imports /capnp/c++.capnp, which pycapnp ships next to its module.
    imports = [str(Path(capnp.__file__).parent.parent)]
    imports += [p for p in ("/usr/include", "/usr/local/include") if Path(p, "capnp").is_dir()]
    return capnp.load(str(ROOT / "common" / "duet.capnp"), imports=imports)


def messages(schema) -> dict[str, object]:
    GenerateRequest = schema.GenerateRequest
    out: dict[str, object] = {}

    out["text_minimal"] = GenerateRequest.new_message(prompt={"text": "Hello"})

    out["text_full"] = GenerateRequest.new_message(
        prompt={"text": "The capital of France is"},
        maxTokens=32,
        sampling={
            "temperature": 0.7,
            "topK": 40,
            "topP": 0.9,
            "minP": 0.05,
            "seed": 1234,
            "repetitionPenalty": 1.1,
            "frequencyPenalty": 0.5,
            "presencePenalty": 0.25,
        },
        stop=["\n", "###"],
        ignoreEos=False,
        includeTokenIds=True,
        model="smollm2-135m",
    )

    out["tokens"] = GenerateRequest.new_message(
        prompt={"tokens": [1, 504, 3458, 314, 4649, 0, 49151]}, maxTokens=8
    )

    out["tokens_edge"] = GenerateRequest.new_message(
        prompt={"tokens": [-1, 2**31 - 1, -(2**31)]}, maxTokens=2**32 - 1
    )

    out["chat"] = GenerateRequest.new_message(
        prompt={
            "chat": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "And times 3?"},
            ]
        },
        maxTokens=16,
        sampling={"temperature": 0.0, "seed": 2**64 - 1},
        stop=["</s>"],
    )

    out["chat_empty"] = GenerateRequest.new_message(prompt={"chat": []})

    msg = GenerateRequest.new_message(prompt={"text": "x"})
    msg.sampling.temperature = float("nan")
    msg.sampling.topP = float("inf")
    msg.sampling.minP = -0.0
    msg.sampling.topK = -5
    msg.sampling.repetitionPenalty = float("-inf")
    out["sampling_nonfinite"] = msg

    # Text is bytes on the wire: BAD_UTF8 (patched in by as_bytes), NULs inside text.
    out["text_bad_utf8"] = GenerateRequest.new_message(
        prompt={"text": BAD_UTF8.decode("latin-1")},
        stop=["a\x00b", "é"],
        model="\x00",
    )
    out["chat_odd_roles"] = GenerateRequest.new_message(
        prompt={"chat": [{"role": "tool", "content": "\x00\x01\x7f"}, {"role": "", "content": ""}]},
        ignoreEos=True,
    )

    out["stop_many"] = GenerateRequest.new_message(
        prompt={"text": "count:"}, stop=[str(i) for i in range(20)] + [""]
    )

    out["empty"] = GenerateRequest.new_message()
    return out


def as_bytes(name: str, message) -> bytes:
    if name == "text_bad_utf8":
        # pycapnp writes str as UTF-8: put the raw bytes in place of the text's encoding (it is
        # longer; NULs fill the rest, inside the text's length).
        data = bytearray(message.to_bytes())
        encoded = BAD_UTF8.decode("latin-1").encode("utf-8")
        at = data.find(encoded)
        assert at >= 0 and len(BAD_UTF8) <= len(encoded)
        data[at : at + len(encoded)] = BAD_UTF8 + b"\x00" * (len(encoded) - len(BAD_UTF8))
        return bytes(data)
    return message.to_bytes()


def multi_segment(schema) -> bytes:
    """The same request in two segments: segment 0 holds only a far pointer to segment 1, which
    is a whole single-segment message (its root pointer is the far pointer's landing pad)."""
    message = schema.GenerateRequest.new_message(
        prompt={"text": "a prompt in the second segment"}, maxTokens=4, stop=["."]
    )
    flat = message.to_bytes()
    (n_minus_1,) = struct.unpack_from("<I", flat, 0)
    assert n_minus_1 == 0, "pycapnp wrote several segments"
    (words,) = struct.unpack_from("<I", flat, 4)
    segment = flat[8 : 8 + 8 * words]
    far = 2 | (0 << 2) | (0 << 3) | (1 << 32)  # far, single landing pad, word 0 of segment 1
    table = struct.pack("<IIII", 1, 1, words, 0)  # 2 segments, their sizes, padding
    return table + struct.pack("<Q", far) + segment


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests/fuzz/corpus/capnp_request"
    out_dir.mkdir(parents=True, exist_ok=True)
    schema = load_schema()
    written = 0
    for name, message in messages(schema).items():
        (out_dir / f"{name}.bin").write_bytes(as_bytes(name, message))
        written += 1
    (out_dir / "multi_segment.bin").write_bytes(multi_segment(schema))
    written += 1
    print(f"wrote {written} messages to {out_dir}")


if __name__ == "__main__":
    main()
