#!/usr/bin/env python3
"""Writes the small GGUF seed files of tests/fuzz/corpus/gguf/ (the fuzzer starts from these).

Most are written with the `gguf` package (llama.cpp's gguf-py); the cases it refuses to write
(empty arrays, an explicit nested-array layout, version 2, no tensors and no metadata at all)
are packed by hand with the same value-type numbers. Every file is valid GGUF that Duet's reader
accepts: the fuzzer mutates from valid structure. The seed tiny_q4_0_mha_tied.gguf is a copy of
tests/fixtures/tiny/ (not written here).

It also writes the libFuzzer dictionary tests/fuzz/gguf.dict: the magic, versions, value-type
tags, common key names (plain and with their u64 length in front), ggml type numbers and
alignments.

Usage: python3 tests/fuzz/make_gguf_seeds.py [OUT_DIR]   (default: tests/fuzz/corpus/gguf)
"""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

T = GGUFValueType


def write_with_gguf(path: Path, fill) -> None:
    writer = GGUFWriter(path, arch="llama")
    fill(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def every_value_type(w: GGUFWriter) -> None:
    """One key of each scalar type (extremes included), strings, arrays of each type, nesting."""
    w.add_uint8("test.u8", 255)
    w.add_int8("test.i8", -128)
    w.add_uint16("test.u16", 65535)
    w.add_int16("test.i16", -32768)
    w.add_uint32("test.u32", 4294967295)
    w.add_int32("test.i32", -2147483648)
    w.add_float32("test.f32", -1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "hello, GGUF \u00e9\u4e2d\U0001f600")
    w.add_string("test.empty_string", "")
    w.add_uint64("test.u64", 2**64 - 1)
    w.add_int64("test.i64", -(2**63))
    w.add_float64("test.f64", 1e300)
    w.add_uint32("general.alignment", 32)
    w.add_uint32("llama.context_length", 2048)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for name, sub, values in [
        ("u8", T.UINT8, [0, 1, 255]),
        ("i8", T.INT8, [-128, 0, 127]),
        ("u16", T.UINT16, [0, 65535]),
        ("i16", T.INT16, [-32768, 32767]),
        ("u32", T.UINT32, [0, 4294967295]),
        ("i32", T.INT32, [-2147483648, -1, 2147483647]),
        ("f32", T.FLOAT32, [0.0, -0.0, 3.25]),
        ("bool", T.BOOL, [True, False, True]),
        ("u64", T.UINT64, [0, 2**64 - 1]),
        ("i64", T.INT64, [-(2**63), 2**63 - 1]),
        ("f64", T.FLOAT64, [0.5, -2.0]),
        ("string", T.STRING, ["a", "", "<|im_start|>"]),
    ]:
        w.add_key_value(f"test.array.{name}", values, T.ARRAY, sub_type=sub)
    # Arrays of arrays (of arrays): element types taken from the first element.
    w.add_array("test.array.nested", [[1, 2], [3], [4, 5, 6]])
    w.add_array("test.array.nested3", [[["x", "y"]], [["z"]]])


def tokenizer_metadata(w: GGUFWriter) -> None:
    """The tokenizer.ggml.* keys of a (tiny) gpt2 vocabulary, as tokenizer_gguf.cpp reads them."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "ab", "\u0120", "\u0120a"]
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 1, 1, 1, 1, 1])
    w.add_token_merges(["a b", "\u0120 a"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_uint32("tokenizer.ggml.padding_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def small_tensors(w: GGUFWriter) -> None:
    """One tiny tensor of several types and ranks (1 to 4 dims)."""
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("f32_1d", np.arange(4, dtype=np.float32))
    w.add_tensor("f16_2d", np.ones((2, 3), dtype=np.float16))
    w.add_tensor("i8_3d", np.arange(8, dtype=np.int8).reshape(2, 2, 2))
    w.add_tensor("i32_4d", np.zeros((1, 1, 2, 1), dtype=np.int32))
    # Quantized rows: the bytes of 1 (Q4_0, 18 bytes per 32) and 2 (Q8_0, 34 bytes per 32) blocks.
    w.add_tensor("q4_0", np.zeros((1, 18), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q4_0)
    w.add_tensor("q8_0", np.zeros((2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    w.add_tensor("empty", np.zeros((0,), dtype=np.float32))


def one_tensor_aligned(w: GGUFWriter) -> None:
    """A non-default alignment (general.alignment = 64) and one tensor."""
    w.add_custom_alignment(64)
    w.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))


# ---------------------------------------------------------------------------
# Hand-packed files (little-endian, GGUF v3 layout unless said otherwise)

def pack_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def pack_array(element: GGUFValueType, items: list[bytes]) -> bytes:
    """An array value (no leading type tag): element type, count, packed items."""
    return struct.pack("<IQ", element, len(items)) + b"".join(items)


def pack_kv(key: str, vtype: GGUFValueType, value: bytes) -> bytes:
    return pack_string(key.encode()) + struct.pack("<I", vtype) + value


def header(version: int, n_tensors: int, kvs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs)) + b"".join(kvs)


def hand_packed() -> dict[str, bytes]:
    files = {}
    files["header_only.gguf"] = header(3, 0, [])
    files["v2_one_key.gguf"] = header(2, 0, [pack_kv("general.architecture", T.STRING,
                                                     pack_string(b"llama"))])
    empty_arrays = [
        pack_kv("test.empty.u8", T.ARRAY, pack_array(T.UINT8, [])),
        pack_kv("test.empty.string", T.ARRAY, pack_array(T.STRING, [])),
        pack_kv("test.empty.array", T.ARRAY, pack_array(T.ARRAY, [])),
        # [[], [[]]]: arrays of arrays with empty members, element types differing per member.
        pack_kv("test.nested.mixed", T.ARRAY, pack_array(T.ARRAY, [
            pack_array(T.FLOAT64, []),
            pack_array(T.ARRAY, [pack_array(T.BOOL, [b"\x01"])]),
        ])),
        # Nested kGgufMaxArrayDepth (8) deep, the deepest the reader accepts.
        pack_kv("test.nested.depth8", T.ARRAY, nested(8)),
    ]
    files["empty_and_deep_arrays.gguf"] = header(3, 0, empty_arrays)
    # One tensor, alignment 1: the data section starts right after the tensor info.
    info = (pack_string(b"t") + struct.pack("<I", 1) + struct.pack("<Q", 3) +
            struct.pack("<I", GGMLQuantizationType.I8) + struct.pack("<Q", 0))
    files["align1_tensor.gguf"] = (header(3, 1, [pack_kv("general.alignment", T.UINT32,
                                                         struct.pack("<I", 1))]) +
                                   info + b"\x01\x02\x03")
    return files


def nested(depth: int) -> bytes:
    """An array value nested `depth` arrays deep, the innermost one u32 [7]."""
    if depth == 1:
        return pack_array(T.UINT32, [struct.pack("<I", 7)])
    return pack_array(T.ARRAY, [nested(depth - 1)])


DICT_KEYS = [
    "general.architecture", "general.name", "general.alignment", "general.file_type",
    "general.quantization_version", "llama.context_length", "llama.embedding_length",
    "llama.block_count", "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base", "llama.vocab_size", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
    "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.chat_template",
    "token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight",
]


def dict_entry(name: str, data: bytes) -> str:
    escaped = "".join(chr(b) if 0x20 <= b < 0x7F and b not in b'"\\' else f"\\x{b:02x}"
                      for b in data)
    return f'{name}="{escaped}"'


def write_dict(path: Path) -> None:
    lines = ["# libFuzzer dictionary for gguf_fuzz, written by tests/fuzz/make_gguf_seeds.py.",
             dict_entry("magic", b"GGUF")]
    lines += [dict_entry(f"version_{v}", struct.pack("<I", v)) for v in (1, 2, 3)]
    lines += [dict_entry(f"type_{t.name.lower()}", struct.pack("<I", t)) for t in T]
    lines += [dict_entry(f"ggml_{q.name.lower()}", struct.pack("<I", q))
              for q in GGMLQuantizationType]
    lines += [dict_entry(f"count_{n}", struct.pack("<Q", n)) for n in (0, 1, 2, 4, 8, 32)]
    lines += [dict_entry(f"alignment_{n}", struct.pack("<I", n)) for n in (1, 16, 32, 64, 3)]
    lines += [dict_entry("u64_max", struct.pack("<Q", 2**64 - 1)),
              dict_entry("i64_max", struct.pack("<Q", 2**63 - 1)),
              dict_entry("u32_max", struct.pack("<I", 2**32 - 1))]
    for i, key in enumerate(DICT_KEYS):
        lines.append(dict_entry(f"key_{i}", key.encode()))
        lines.append(dict_entry(f"key_{i}_sized", pack_string(key.encode())))
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "corpus" / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    write_with_gguf(out / "every_value_type.gguf", every_value_type)
    write_with_gguf(out / "tokenizer_metadata.gguf", tokenizer_metadata)
    write_with_gguf(out / "small_tensors.gguf", small_tensors)
    write_with_gguf(out / "one_tensor_aligned64.gguf", one_tensor_aligned)
    for name, data in hand_packed().items():
        (out / name).write_bytes(data)
    write_dict(Path(__file__).parent / "gguf.dict")
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size:8d}  {path}")


if __name__ == "__main__":
    main()
