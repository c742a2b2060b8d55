#!/usr/bin/env python3
"""Write a synthetic Llama-shaped GGUF model, with the standard library only.

The GPU run measures decode and prefill on a model large enough for the
memory and the GEMM rooflines to show (an 8B one), on a machine that may have
neither the model files nor numpy or the `gguf` package. The weights are
random but well scaled (each matrix's values have a standard deviation of
1 / sqrt(fan_in), norm weights near 1), so the forward pass stays finite; the
text it writes means nothing.

Speed comes from repetition: per weight type and fan-in, one pool of
POOL_BLOCKS random quantized blocks (a prime count, so that the rows of a
matrix do not repeat) is drawn, and every tensor is that pool repeated from a
phase of its own. The file is written in WRITE_BYTES writes of a buffer that
holds the pool over and over, so an 8B model takes the disk's time.

    synthetic_model.py --shape llama3-8b --type q4_0 --out llama3-8b-q4_0.gguf
    synthetic_model.py --shape smollm2-135m --type q8_0 --layers 2 --out small.gguf

The tokenizer is a byte-level BPE vocabulary without merges (three control
tokens, the 256 byte tokens, then filler tokens up to the shape's vocabulary
size), enough for `duet generate` to tokenize any prompt and print any token.
tests/gpu/synthetic_model_test.py reads the file back against this module's
expected_block().
"""
import argparse
import math
import random
import struct
import sys
import time
from dataclasses import dataclass

GGUF_VERSION = 3
ALIGNMENT = 32
POOL_BLOCKS = 4099  # prime: a matrix's rows start at different phases of the pool
WRITE_BYTES = 16 << 20
SEED = 20250

# GGUF metadata value types.
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    n_ff: int
    n_vocab: int
    context_length: int
    rope_freq_base: float
    tied: bool  # the output head is token_embd
    pre: str  # tokenizer.ggml.pre


SHAPES = {
    # SmolLM2-135M (the default model's shape).
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, 8192, 100000.0, True, "smollm"),
    # Llama-3-8B.
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, False, "llama-bpe"),
}


@dataclass(frozen=True)
class QuantType:
    ggml_type: int  # the tensor type in the file
    file_type: int  # general.file_type (llama_ftype)
    block_elements: int
    block_bytes: int


TYPES = {
    "q4_0": QuantType(2, 2, 32, 18),
    "q4_1": QuantType(3, 3, 32, 20),
    "q8_0": QuantType(8, 7, 32, 34),
}
F32_TYPE = QuantType(0, 0, 1, 4)

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple  # GGUF order: ne[0] is the row length
    qtype: QuantType
    pool: tuple  # the key of the pool its bytes repeat
    phase: int  # the pool block its first block is


def tensor_plans(shape, qtype, n_layers):
    """Every tensor of the model, in file order."""
    q_dim = shape.n_embd
    kv_dim = shape.n_kv_heads * (shape.n_embd // shape.n_heads)
    entries = [("token_embd.weight", (shape.n_embd, shape.n_vocab), shape.n_embd)]
    for i in range(n_layers):
        p = f"blk.{i}."
        entries += [
            (p + "attn_norm.weight", (shape.n_embd,), None),
            (p + "attn_q.weight", (shape.n_embd, q_dim), shape.n_embd),
            (p + "attn_k.weight", (shape.n_embd, kv_dim), shape.n_embd),
            (p + "attn_v.weight", (shape.n_embd, kv_dim), shape.n_embd),
            (p + "attn_output.weight", (q_dim, shape.n_embd), q_dim),
            (p + "ffn_norm.weight", (shape.n_embd,), None),
            (p + "ffn_gate.weight", (shape.n_embd, shape.n_ff), shape.n_embd),
            (p + "ffn_up.weight", (shape.n_embd, shape.n_ff), shape.n_embd),
            (p + "ffn_down.weight", (shape.n_ff, shape.n_embd), shape.n_ff),
        ]
    entries.append(("output_norm.weight", (shape.n_embd,), None))
    if not shape.tied:
        entries.append(("output.weight", (shape.n_embd, shape.n_vocab), shape.n_embd))
    plans = []
    for index, (name, ne, fan_in) in enumerate(entries):
        t = F32_TYPE if fan_in is None else qtype
        pool = ("norm",) if fan_in is None else (t.ggml_type, fan_in)
        plans.append(TensorPlan(name, ne, t, pool, index * 7919 % POOL_BLOCKS))
    return plans


def tensor_bytes(plan):
    n = math.prod(plan.ne)
    return n // plan.qtype.block_elements * plan.qtype.block_bytes


def half(x):
    return struct.pack("<e", x)


def no_minus_128(raw):
    """int8 quants as ggml's quantizers make them: -127..127."""
    return raw.translate(bytes(b if b != 0x80 else 0x81 for b in range(256)))


def make_pool(key):
    """POOL_BLOCKS random blocks for one pool key (deterministic)."""
    rng = random.Random(f"{SEED}/{key}")
    if key == ("norm",):
        return struct.pack(f"<{POOL_BLOCKS}f",
                           *(1.0 + 0.1 * rng.gauss(0.0, 1.0) for _ in range(POOL_BLOCKS)))
    ggml_type, fan_in = key
    sigma = 1.0 / math.sqrt(fan_in)
    blocks = []
    for _ in range(POOL_BLOCKS):
        jitter = 0.75 + 0.5 * rng.random()
        if ggml_type == TYPES["q4_0"].ggml_type:  # d * (q - 8), q uniform in 0..15: sd 4.6 d
            blocks.append(half(sigma / 4.6 * jitter) + rng.randbytes(16))
        elif ggml_type == TYPES["q4_1"].ggml_type:  # d * q + m, centred by m = -7.5 d
            d = sigma / 4.6 * jitter
            blocks.append(half(d) + half(-7.5 * d) + rng.randbytes(16))
        else:  # q8_0: d * q, q uniform in -127..127: sd 73.6 d
            blocks.append(half(sigma / 73.6 * jitter) + no_minus_128(rng.randbytes(32)))
    return b"".join(blocks)


class Pools:
    """Each pool once, with a copy long enough to write from any phase."""

    def __init__(self):
        self.pools = {}
        self.buffers = {}

    def pool(self, key):
        if key not in self.pools:
            self.pools[key] = make_pool(key)
        return self.pools[key]

    def buffer(self, key):
        """The pool repeated to at least WRITE_BYTES past any phase."""
        if key not in self.buffers:
            pool = self.pool(key)
            repeats = (WRITE_BYTES + len(pool)) // len(pool) + 1
            self.buffers[key] = memoryview(pool * repeats)
        return self.buffers[key]


def expected_block(pools, plan, block):
    """The bytes of block `block` of the tensor `plan` describes."""
    size = plan.qtype.block_bytes
    start = (plan.phase + block) % POOL_BLOCKS * size
    return pools.pool(plan.pool)[start:start + size]


def byte_level_char(b):
    """GPT-2's byte-to-character table (byte-level BPE token spelling)."""
    printable = list(range(0x21, 0x7f)) + list(range(0xa1, 0xad)) + list(range(0xae, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def vocabulary(n_vocab):
    """(tokens, token types): control tokens, byte tokens, fillers."""
    tokens = CONTROL_TOKENS + [byte_level_char(b) for b in range(256)]
    tokens += [f"<syn{i}>" for i in range(len(tokens), n_vocab)]
    types = [3] * len(CONTROL_TOKENS) + [1] * (n_vocab - len(CONTROL_TOKENS))  # control, normal
    return tokens, types


class Writer:
    """GGUF fields into one buffered file."""

    def __init__(self, f):
        self.f = f

    def raw(self, data):
        self.f.write(data)

    def string(self, s):
        data = s.encode("utf-8")
        self.raw(struct.pack("<Q", len(data)) + data)

    def kv(self, key, gtype, value):
        self.string(key)
        self.raw(struct.pack("<I", gtype))
        if gtype == STRING:
            self.string(value)
        elif gtype == U32:
            self.raw(struct.pack("<I", value))
        elif gtype == F32:
            self.raw(struct.pack("<f", value))
        elif gtype == BOOL:
            self.raw(struct.pack("<B", 1 if value else 0))
        else:
            raise ValueError(f"metadata type {gtype}")

    def array(self, key, element_type, values):
        self.string(key)
        self.raw(struct.pack("<IIQ", ARRAY, element_type, len(values)))
        if element_type == STRING:
            self.raw(b"".join(struct.pack("<Q", len(e)) + e for e in (v.encode() for v in values)))
        elif element_type == I32:
            self.raw(struct.pack(f"<{len(values)}i", *values))
        else:
            raise ValueError(f"array element type {element_type}")


def metadata(shape_name, shape, type_name, n_layers):
    """(key, type, value) of every scalar key, in file order."""
    head_dim = shape.n_embd // shape.n_heads
    a = "llama."
    return [
        ("general.architecture", STRING, "llama"),
        ("general.name", STRING, f"synthetic {shape_name} {type_name}"),
        ("general.alignment", U32, ALIGNMENT),
        ("general.file_type", U32, TYPES[type_name].file_type),
        (a + "context_length", U32, shape.context_length),
        (a + "embedding_length", U32, shape.n_embd),
        (a + "block_count", U32, n_layers),
        (a + "feed_forward_length", U32, shape.n_ff),
        (a + "attention.head_count", U32, shape.n_heads),
        (a + "attention.head_count_kv", U32, shape.n_kv_heads),
        (a + "rope.dimension_count", U32, head_dim),
        (a + "rope.freq_base", F32, shape.rope_freq_base),
        (a + "attention.layer_norm_rms_epsilon", F32, 1e-5),
        (a + "vocab_size", U32, shape.n_vocab),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, shape.pre),
        ("tokenizer.ggml.bos_token_id", U32, BOS_ID),
        ("tokenizer.ggml.eos_token_id", U32, EOS_ID),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
    ]


def padding(offset):
    return (ALIGNMENT - offset % ALIGNMENT) % ALIGNMENT


def write_model(path, shape_name, type_name, n_layers=None):
    """Writes the model; returns (tensor plans, bytes written)."""
    shape = SHAPES[shape_name]
    n_layers = shape.n_layers if n_layers is None else n_layers
    plans = tensor_plans(shape, TYPES[type_name], n_layers)
    keys = metadata(shape_name, shape, type_name, n_layers)
    tokens, types = vocabulary(shape.n_vocab)
    pools = Pools()
    with open(path, "wb", buffering=WRITE_BYTES) as f:
        w = Writer(f)
        w.raw(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(plans), len(keys) + 2))
        for key, gtype, value in keys:
            w.kv(key, gtype, value)
        w.array("tokenizer.ggml.tokens", STRING, tokens)
        w.array("tokenizer.ggml.token_type", I32, types)
        offset = 0
        for plan in plans:
            w.string(plan.name)
            w.raw(struct.pack("<I", len(plan.ne)) + struct.pack(f"<{len(plan.ne)}Q", *plan.ne))
            w.raw(struct.pack("<IQ", plan.qtype.ggml_type, offset))
            offset += tensor_bytes(plan)
            offset += padding(offset)
        w.raw(bytes(padding(f.tell())))
        for plan in plans:
            buffer = pools.buffer(plan.pool)
            pool_bytes = len(pools.pool(plan.pool))
            start = plan.phase * plan.qtype.block_bytes
            left = tensor_bytes(plan)
            while left > 0:
                n = min(left, WRITE_BYTES)
                f.write(buffer[start:start + n])
                start = (start + n) % pool_bytes
                left -= n
            w.raw(bytes(padding(tensor_bytes(plan))))
        size = f.tell()
    return plans, size


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_0")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape's (tests)")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    args = ap.parse_args()
    if args.layers is not None and not 1 <= args.layers <= SHAPES[args.shape].n_layers:
        ap.error(f"--layers takes 1 to {SHAPES[args.shape].n_layers}")
    start = time.monotonic()
    plans, size = write_model(args.out, args.shape, args.type, args.layers)
    seconds = time.monotonic() - start
    print(f"wrote {args.out}: {args.shape} {args.type}, {len(plans)} tensors, "
          f"{size / 1e9:.2f} GB in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
