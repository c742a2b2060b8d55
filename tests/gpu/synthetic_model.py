#!/usr/bin/env python3
"""Write a synthetic Llama-shaped GGUF model, with the standard library only.

The GPU run measures decode and prefill on a model large enough for the
memory and the GEMM rooflines to show (an 8B one), on a machine that may have
neither the model files nor numpy or the `gguf` package. The weights are
random but well scaled (each matrix's values have a mean of 0 and a standard
deviation of 1 / sqrt(fan_in), norm weights near 1, Qwen2's Q/K/V biases near
0), so the forward pass stays finite and its greedy tokens follow the prompt
(bench/greedy_margins.py sets them beside llama.cpp's); the text they make
means nothing.

Speed comes from repetition: per weight type and fan-in, one pool of
POOL_BLOCKS random quantized blocks (a prime count, so that the rows of a
matrix do not repeat) is drawn, and every tensor is that pool repeated from a
phase of its own; token_embd and output, one row per token, read it with a
stride that changes every POOL_BLOCKS rows, so that no two tokens share a
row (row_stride). The file is written in WRITE_BYTES writes of a buffer that
holds the pool over and over, so an 8B model takes the disk's time.

    synthetic_model.py --shape llama3-8b --type q4_0 --out llama3-8b-q4_0.gguf
    synthetic_model.py --shape llama3.2-1b --type q4_k_m --layers 2 --out small.gguf
    synthetic_model.py --shape smollm2-135m --type q8_0 --layers 2 --out small.gguf
    synthetic_model.py --shape qwen3-8b --type q4_0 --layers 4 --out qwen3-4-layers.gguf
    synthetic_model.py --shape qwen3moe-30b-a3b --type q4_0 --layers 8 --out moe.gguf

Types: q4_0, q4_1, q8_0, q4_k, q5_k and q6_k put every matrix in that type (as
`llama-quantize --pure` would); q4_k_m is the mix llama.cpp's quantizer makes
for Q4_K_M (see matrix_type). K-quants need rows that are multiples of 256:
where a row is not, the type falls back as llama.cpp's does (Q6_K to Q8_0),
so Q4_K becomes Q5_0 and Q6_K Q8_0 in rows of 576 (SmolLM2's), as llama.cpp's
quantizer makes them.

The tokenizer is a byte-level BPE vocabulary (three control tokens, the 256
byte tokens, the one merge MERGE's result, then filler tokens up to the
shape's vocabulary size) with that single merge, enough for `duet generate`
and llama.cpp (which refuses a BPE vocabulary without merges) to tokenize any
prompt and print any token. tests/gpu/synthetic_model_test.py reads the file
back against this module's expected_block().
"""
import argparse
import collections
import math
import random
import struct
import sys
import time
import dataclasses
from dataclasses import dataclass

from gguf_write import BOOL, F32, I32, STRING, U32, Writer, vocabulary

GGUF_VERSION = 3
ALIGNMENT = 32
POOL_BLOCKS = 4099  # prime: a matrix's rows start at different phases of the pool
WRITE_BYTES = 16 << 20
SEED = 20250

# GGUF metadata value types.


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
    architecture: str = "llama"  # general.architecture, and the prefix of its keys
    rms_eps: float = 1e-5
    qkv_bias: bool = False  # attn_q/k/v.bias (F32) in every layer, as Qwen2 has
    head_dim: int = 0  # attention.key_length when set (Qwen3's heads), else n_embd / n_heads
    qk_norm: bool = False  # attn_q_norm/attn_k_norm (F32, head_dim) in every layer, as Qwen3 has
    post_norms: bool = False  # post_attention_norm/post_ffw_norm (F32, n_embd), as Gemma 3 has
    sliding_window: int = 0  # attention.sliding_window (Gemma 3: 5 layers in 6 windowed)
    # A mixture of experts in every layer (qwen3moe, Mixtral's llama): ffn_gate_inp (the router,
    # F32 as llama.cpp's quantizer leaves it) and ffn_{gate,up,down}_exps of n_experts experts
    # of n_ff_exp hidden units (0: n_ff), n_experts_used of them per token.
    n_experts: int = 0
    n_experts_used: int = 0
    n_ff_exp: int = 0

    @property
    def head_size(self):
        return self.head_dim or self.n_embd // self.n_heads

    @property
    def expert_ff(self):
        return self.n_ff_exp or self.n_ff


SHAPES = {
    # SmolLM2-135M (the default model's shape).
    "smollm2-135m": Shape(576, 30, 9, 3, 1536, 49152, 8192, 100000.0, True, "smollm"),
    # Llama-3-8B.
    "llama3-8b": Shape(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, False, "llama-bpe"),
    # Llama-3.2-1B: its trained context, but no rope_freqs tensor (the "llama3"
    # long-context RoPE scaling), which a speed measurement does not need.
    "llama3.2-1b": Shape(2048, 16, 32, 8, 8192, 128256, 131072, 500000.0, True, "llama-bpe"),
    # Qwen2.5-7B (context as its config.json's max_position_embeddings).
    "qwen2.5-7b": Shape(3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0, False, "qwen2",
                        architecture="qwen2", rms_eps=1e-6, qkv_bias=True),
    # Qwen3-0.6B and Qwen3-8B (config.json: heads of 128, wider than n_embd / n_heads in 0.6B).
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 3072, 151936, 40960, 1000000.0, True, "qwen2",
                        architecture="qwen3", rms_eps=1e-6, head_dim=128, qk_norm=True),
    "qwen3-8b": Shape(4096, 36, 32, 8, 12288, 151936, 40960, 1000000.0, False, "qwen2",
                      architecture="qwen3", rms_eps=1e-6, head_dim=128, qk_norm=True),
    # Gemma 3 1B (config.json: heads of 256 over n_embd 1152, one KV head, a 512-token window on
    # the local layers, rope_theta 1e6 for the global ones). Its real tokenizer is SentencePiece;
    # the generator's is byte-level BPE of the same size, which speed does not see.
    "gemma3-1b": Shape(1152, 26, 4, 1, 6912, 262144, 32768, 1000000.0, True, "default",
                       architecture="gemma3", rms_eps=1e-6, head_dim=256, qk_norm=True,
                       post_norms=True, sliding_window=512),
    # Qwen3-30B-A3B (config.json: 128 experts of 768 hidden units, 8 per token, heads of 128).
    "qwen3moe-30b-a3b": Shape(2048, 48, 32, 4, 6144, 151936, 40960, 1000000.0, False, "qwen2",
                              architecture="qwen3moe", rms_eps=1e-6, head_dim=128, qk_norm=True,
                              n_experts=128, n_experts_used=8, n_ff_exp=768),
    # Mixtral-8x7B (8 experts of Mistral-7B's feed-forward, 2 per token).
    "mixtral-8x7b": Shape(4096, 32, 32, 8, 14336, 32000, 32768, 1000000.0, False, "default",
                          n_experts=8, n_experts_used=2),
}


@dataclass(frozen=True)
class QuantType:
    """A tensor type: its ggml type id and block layout."""
    name: str
    ggml_type: int
    block_elements: int
    block_bytes: int


F32_TYPE = QuantType("F32", 0, 1, 4)
Q4_0 = QuantType("Q4_0", 2, 32, 18)
Q4_1 = QuantType("Q4_1", 3, 32, 20)
Q5_0 = QuantType("Q5_0", 6, 32, 22)  # Q4_K's fallback
Q5_1 = QuantType("Q5_1", 7, 32, 24)  # Q5_K's fallback (Duet does not read it)
Q8_0 = QuantType("Q8_0", 8, 32, 34)
Q4_K = QuantType("Q4_K", 12, 256, 144)
Q5_K = QuantType("Q5_K", 13, 256, 176)
Q6_K = QuantType("Q6_K", 14, 256, 210)

# llama.cpp's tensor_type_fallback (src/llama-quant.cpp) for a row length
# that is not a multiple of the type's block.
FALLBACK = {Q4_K: Q5_0, Q5_K: Q5_1, Q6_K: Q8_0}
READABLE_BY_DUET = {F32_TYPE, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K}


@dataclass(frozen=True)
class FileType:
    """A --type: general.file_type (llama_ftype) and the matrices' types."""
    name: str
    file_type: int
    base: QuantType  # every matrix's type, unless q4_k_m_mix says otherwise
    q4_k_m_mix: bool = False


TYPES = {t.name: t for t in (
    FileType("q4_0", 2, Q4_0),  # LLAMA_FTYPE_MOSTLY_Q4_0
    FileType("q4_1", 3, Q4_1),  # LLAMA_FTYPE_MOSTLY_Q4_1
    FileType("q8_0", 7, Q8_0),  # LLAMA_FTYPE_MOSTLY_Q8_0
    FileType("q4_k", 14, Q4_K),  # LLAMA_FTYPE_MOSTLY_Q4_K_S, every matrix Q4_K
    FileType("q5_k", 16, Q5_K),  # LLAMA_FTYPE_MOSTLY_Q5_K_S, every matrix Q5_K
    FileType("q6_k", 18, Q6_K),  # LLAMA_FTYPE_MOSTLY_Q6_K
    FileType("q4_k_m", 15, Q4_K, q4_k_m_mix=True),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
)}

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple  # GGUF order: ne[0] is the row length
    qtype: QuantType
    pool: tuple  # the key of the pool its bytes repeat
    phase: int  # the pool block its first block is
    unique_rows: bool = False  # token_embd and output: no two rows alike (see row_stride)


def use_more_bits(i_layer, n_layers):
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down Q4_K_M lifts."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def matrix_type(ftype, name, n_layers, row_length, tied, shape_name="?"):
    """The type of the matrix `name` (`blk.N.ROLE.weight` or `ROLE.weight`).

    q4_k_m follows llama_tensor_get_type_impl in llama.cpp's src/llama-quant.cpp
    (the llama.cpp of llama-cpp-python 0.3.36, as bench/build_llama_cpp.sh
    builds it) for LLAMA_FTYPE_MOSTLY_Q4_K_M on a `llama` or `qwen2` model
    (no experts, not Falcon, not 70B, no imatrix, no overrides):
      - `output`, and `token_embd` when the file has no `output` (tied): Q6_K,
        or Q8_0 when the row length is not a multiple of 256;
      - `attn_v` and `ffn_down` in the layers where use_more_bits(i, n) holds
        (i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, integer division): Q6_K
        (llama.cpp passes counters of the attn_v and ffn_down tensors seen so
        far, and visits tensors in layer order, so i is the layer);
      - everything else, an untied token_embd included: Q4_K.
    Then tensor_type_fallback: a K-quant whose row length is not a multiple
    of 256 becomes Q5_0 (from Q4_K) or Q8_0 (from Q6_K); a fallback Duet
    could not read would raise ValueError.
    """
    parts = name.split(".")
    role = parts[-2]
    i_layer = int(parts[1]) if parts[0] == "blk" else -1
    t = ftype.base
    if ftype.q4_k_m_mix:
        if role == "output" or (role == "token_embd" and tied):
            t = Q8_0 if row_length % t.block_elements else Q6_K
        elif role in ("attn_v", "ffn_down") and use_more_bits(i_layer, n_layers):
            t = Q6_K
    if row_length % t.block_elements:
        fallback = FALLBACK.get(t)
        if fallback not in READABLE_BY_DUET:
            raise ValueError(
                f"--type {ftype.name} needs rows that are multiples of {t.block_elements}; shape "
                f"{shape_name} has {row_length} ({name}); llama.cpp would fall back to "
                f"{fallback.name if fallback else 'nothing'}, which Duet does not read")
        t = fallback
    return t


def tensor_plans(shape, ftype, n_layers, shape_name="?"):
    """Every tensor of the model, in file order; ValueError when `ftype` cannot hold it."""
    q_dim = shape.n_heads * shape.head_size
    kv_dim = shape.n_kv_heads * shape.head_size
    # (name, ne, fan_in (None: a vector), the pool of a vector). Gemma's graph scales
    # the embedding by sqrt(n_embd), so its rows are drawn that much smaller: else a
    # token's own row outweighs the layers in the tied head, and greedy repeats it.
    embd_fan_in = shape.n_embd ** 2 if shape.architecture == "gemma3" else shape.n_embd
    entries = [("token_embd.weight", (shape.n_embd, shape.n_vocab), embd_fan_in, None)]
    for i in range(n_layers):
        p = f"blk.{i}."
        layer = [
            (p + "attn_norm.weight", (shape.n_embd,), None, "norm"),
            (p + "attn_q.weight", (shape.n_embd, q_dim), shape.n_embd, None),
            (p + "attn_k.weight", (shape.n_embd, kv_dim), shape.n_embd, None),
            (p + "attn_v.weight", (shape.n_embd, kv_dim), shape.n_embd, None),
            (p + "attn_output.weight", (q_dim, shape.n_embd), q_dim, None),
            (p + "ffn_norm.weight", (shape.n_embd,), None, "norm"),
        ]
        if shape.n_experts:
            n_exp, ff = shape.n_experts, shape.expert_ff
            layer += [
                (p + "ffn_gate_inp.weight", (shape.n_embd, n_exp), shape.n_embd, "router"),
                (p + "ffn_gate_exps.weight", (shape.n_embd, ff, n_exp), shape.n_embd, None),
                (p + "ffn_down_exps.weight", (ff, shape.n_embd, n_exp), ff, None),
                (p + "ffn_up_exps.weight", (shape.n_embd, ff, n_exp), shape.n_embd, None),
            ]
        else:
            layer += [
                (p + "ffn_gate.weight", (shape.n_embd, shape.n_ff), shape.n_embd, None),
                (p + "ffn_up.weight", (shape.n_embd, shape.n_ff), shape.n_embd, None),
                (p + "ffn_down.weight", (shape.n_ff, shape.n_embd), shape.n_ff, None),
            ]
        if shape.qkv_bias:
            layer[2:2] = [(p + "attn_q.bias", (q_dim,), None, "bias")]
            layer[4:4] = [(p + "attn_k.bias", (kv_dim,), None, "bias")]
            layer[6:6] = [(p + "attn_v.bias", (kv_dim,), None, "bias")]
        if shape.qk_norm:
            at = layer.index((p + "attn_output.weight", (q_dim, shape.n_embd), q_dim, None))
            layer[at:at] = [(p + "attn_q_norm.weight", (shape.head_size,), None, "norm"),
                            (p + "attn_k_norm.weight", (shape.head_size,), None, "norm")]
        if shape.post_norms:
            at = layer.index((p + "ffn_norm.weight", (shape.n_embd,), None, "norm"))
            layer[at:at] = [(p + "post_attention_norm.weight", (shape.n_embd,), None, "norm")]
            layer.append((p + "post_ffw_norm.weight", (shape.n_embd,), None, "norm"))
        entries += layer
    entries.append(("output_norm.weight", (shape.n_embd,), None, "norm"))
    if not shape.tied:
        entries.append(("output.weight", (shape.n_embd, shape.n_vocab), shape.n_embd, None))
    plans = []
    if shape.n_experts and ftype.q4_k_m_mix:
        raise ValueError(f"--type {ftype.name}: the quantizer's mix for experts is not modelled; "
                         f"shape {shape_name} takes a single type (q4_0, q4_1, q8_0, q4_k, q6_k)")
    for index, (name, ne, fan_in, vector) in enumerate(entries):
        if fan_in is None:
            t, pool = F32_TYPE, (vector,)
        elif vector == "router":
            t, pool = F32_TYPE, (F32_TYPE.ggml_type, fan_in)
        else:
            t = matrix_type(ftype, name, n_layers, ne[0], shape.tied, shape_name)
            pool = (t.ggml_type, fan_in)
        unique = name in ("token_embd.weight", "output.weight")
        plans.append(TensorPlan(name, ne, t, pool, index * 7919 % POOL_BLOCKS, unique))
    return plans


# Rows of token_embd and output (one per token) must not repeat: a pool read
# straight through repeats every POOL_BLOCKS rows, so tokens t and t + 4,099
# would get the same embedding and, worse, exactly the same logit, a tie that
# two engines break differently. Row r reads the pool with stride
# row_stride(r) = 1 + r // POOL_BLOCKS: block j of the row is pool block
# ((phase + r * blocks_per_row + j) * stride) mod POOL_BLOCKS. Within a run
# of POOL_BLOCKS rows the starts differ (POOL_BLOCKS is prime), and rows of
# two runs differ in their stride, so no two rows are alike.
def row_stride(row):
    stride = 1 + row // POOL_BLOCKS
    assert stride < POOL_BLOCKS, "more rows than distinct strides"
    return stride


def blocks_per_row(plan):
    return plan.ne[0] // plan.qtype.block_elements


def tensor_bytes(plan):
    n = math.prod(plan.ne)
    assert n % plan.qtype.block_elements == 0, plan
    return n // plan.qtype.block_elements * plan.qtype.block_bytes


def half(x):
    return struct.pack("<e", x)


def no_minus_128(raw):
    """int8 quants as ggml's quantizers make them: -127..127."""
    return raw.translate(bytes(b if b != 0x80 else 0x81 for b in range(256)))


# Q4_0's and Q5_0's codes come from 1..15 and 1..31: centred, as a quantizer makes
# them. From 0..15 they average -0.5, a common mode in every matrix's outputs that
# compounds over the layers until greedy picks one token whatever the prompt.
SD_4BIT_CENTRED = math.sqrt((15 ** 2 - 1) / 12)  # 4.32
SD_5BIT_CENTRED = math.sqrt((31 ** 2 - 1) / 12)  # 8.94


def centred_nibbles(rng, n_bytes):
    """n_bytes of two 4-bit codes each, every code uniform in 1..15."""
    return bytes(rng.randint(1, 15) | rng.randint(1, 15) << 4 for _ in range(n_bytes))


def centred_q5_0(rng):
    """A Q5_0 block's qh and qs: 32 codes uniform in 1..31 (code j's fifth bit is qh's
    bit j, its low 4 bits qs[j % 16]'s low nibble for j < 16, else its high one)."""
    q = [rng.randint(1, 31) for _ in range(32)]
    qh = sum((q[j] >> 4) << j for j in range(32))
    qs = bytes((q[j] & 15) | (q[j + 16] & 15) << 4 for j in range(16))
    return struct.pack("<I", qh) + qs


# Root mean squares of the K-quant codes drawn below (uniform integers).
SD_4BIT = math.sqrt((16 ** 2 - 1) / 12)  # q - 7.5 for q in 0..15: 4.61
SD_5BIT = math.sqrt((32 ** 2 - 1) / 12)  # q - 15.5 for q in 0..31: 9.23
SD_6BIT = math.sqrt((64 ** 2 - 1) / 12 + 0.25)  # q - 32 for q in 0..63 (mean -0.5): 18.48
Q4_K_SCALES = range(32, 64)  # 6-bit sub-block scales; rms 48.4
Q6_K_SCALES = range(64, 128)  # int8 sub-block scale magnitudes; rms 97.3


def rms(values):
    return math.sqrt(sum(v * v for v in values) / len(values))


def pack_q4_k_scales(sc, m):
    """The 12 `scales` bytes of a Q4_K block from 8 six-bit scales and mins.

    The inverse of ggml's get_scale_min_k4: for s < 4, sc[s] and m[s] are the
    low 6 bits of bytes s and s + 4; for s >= 4, their low 4 bits sit in byte
    s + 4 (sc low nibble, m high) and their top 2 bits in the top bits of
    bytes s - 4 (sc) and s (m).
    """
    assert all(0 <= v < 64 for v in sc + m), (sc, m)
    out = bytearray(12)
    for s in range(4):
        out[s] = sc[s] | (sc[s + 4] >> 4) << 6
        out[s + 4] = m[s] | (m[s + 4] >> 4) << 6
        out[s + 8] = (sc[s + 4] & 15) | (m[s + 4] & 15) << 4
    return bytes(out)


def make_pool(key):
    """POOL_BLOCKS random blocks for one pool key (deterministic)."""
    rng = random.Random(f"{SEED}/{key}")
    if key == ("norm",):
        return struct.pack(f"<{POOL_BLOCKS}f",
                           *(1.0 + 0.1 * rng.gauss(0.0, 1.0) for _ in range(POOL_BLOCKS)))
    if key == ("bias",):
        return struct.pack(f"<{POOL_BLOCKS}f",
                           *(0.1 * rng.gauss(0.0, 1.0) for _ in range(POOL_BLOCKS)))
    ggml_type, fan_in = key
    sigma = 1.0 / math.sqrt(fan_in)
    sc_rms = rms(Q4_K_SCALES)
    q6_rms = rms(Q6_K_SCALES)
    blocks = []
    for _ in range(POOL_BLOCKS):
        jitter = 0.75 + 0.5 * rng.random()
        if ggml_type == F32_TYPE.ggml_type:  # a matrix of floats (a router)
            blocks.append(struct.pack("<f", sigma * rng.gauss(0.0, 1.0)))
        elif ggml_type == Q4_0.ggml_type:  # d * (q - 8), q uniform in 1..15: sd 4.32 d
            blocks.append(half(sigma / SD_4BIT_CENTRED * jitter) + centred_nibbles(rng, 16))
        elif ggml_type == Q4_1.ggml_type:  # d * q + m, centred by m = -7.5 d
            d = sigma / 4.6 * jitter
            blocks.append(half(d) + half(-7.5 * d) + rng.randbytes(16))
        elif ggml_type == Q5_0.ggml_type:  # d * (q - 16), q uniform in 1..31: sd 8.94 d
            blocks.append(half(sigma / SD_5BIT_CENTRED * jitter) + centred_q5_0(rng))
        elif ggml_type == Q8_0.ggml_type:  # d * q, q uniform in -127..127: sd 73.6 d
            blocks.append(half(sigma / 73.6 * jitter) + no_minus_128(rng.randbytes(32)))
        elif ggml_type == Q4_K.ggml_type:
            # d * sc[s] * q - dmin * m[s], q uniform in 0..15: with dmin = 7.5 d
            # and m[s] = sc[s] every sub-block is centred, sd d * sc[s] * 4.61.
            d = sigma / (SD_4BIT * sc_rms) * jitter
            sc = [rng.choice(Q4_K_SCALES) for _ in range(8)]
            blocks.append(half(d) + half(7.5 * d) + pack_q4_k_scales(sc, sc)
                          + rng.randbytes(128))
        elif ggml_type == Q5_K.ggml_type:  # Q4_K's, with q in 0..31 (qh) centred by 15.5 d
            d = sigma / (SD_5BIT * sc_rms) * jitter
            sc = [rng.choice(Q4_K_SCALES) for _ in range(8)]
            blocks.append(half(d) + half(15.5 * d) + pack_q4_k_scales(sc, sc)
                          + rng.randbytes(32) + rng.randbytes(128))
        elif ggml_type == Q6_K.ggml_type:
            # d * scales[s] * (q - 32), q uniform in 0..63; scales of either sign.
            d = sigma / (SD_6BIT * q6_rms) * jitter
            scales = [rng.choice(Q6_K_SCALES) * rng.choice((-1, 1)) for _ in range(16)]
            blocks.append(rng.randbytes(128) + rng.randbytes(64)
                          + struct.pack("<16b", *scales) + half(d))
        else:
            raise ValueError(f"no pool for ggml type {ggml_type}")
    return b"".join(blocks)


class Pools:
    """Each pool once, with a copy long enough to write from any phase."""

    def __init__(self):
        self.pools = {}
        self.buffers = {}
        self.strided = {}

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

    def strided_buffer(self, key, size, stride):
        """The pool's blocks (of `size` bytes) in the order i -> i * stride, twice over."""
        if (key, stride) not in self.strided:
            pool = self.pool(key)
            starts = ((i * stride) % POOL_BLOCKS * size for i in range(POOL_BLOCKS))
            order = b"".join(pool[at:at + size] for at in starts)
            self.strided[key, stride] = memoryview(order * 2)
        return self.strided[key, stride]


def expected_block(pools, plan, block):
    """The bytes of block `block` of the tensor `plan` describes."""
    size = plan.qtype.block_bytes
    stride = row_stride(block // blocks_per_row(plan)) if plan.unique_rows else 1
    start = (plan.phase + block) * stride % POOL_BLOCKS * size
    return pools.pool(plan.pool)[start:start + size]


def metadata(shape_name, shape, type_name, n_layers):
    """(key, type, value) of every scalar key, in file order."""
    a = shape.architecture + "."
    heads = [(a + "attention.key_length", U32, shape.head_dim),
             (a + "attention.value_length", U32, shape.head_dim)] if shape.head_dim else []
    window = [(a + "attention.sliding_window", U32, shape.sliding_window)] if shape.sliding_window else []
    experts = []
    if shape.n_experts:
        experts = [(a + "expert_count", U32, shape.n_experts),
                   (a + "expert_used_count", U32, shape.n_experts_used)]
        if shape.n_ff_exp:
            experts.append((a + "expert_feed_forward_length", U32, shape.n_ff_exp))
    return [
        ("general.architecture", STRING, shape.architecture),
        ("general.name", STRING, f"synthetic {shape_name} {type_name}"),
        ("general.alignment", U32, ALIGNMENT),
        ("general.file_type", U32, TYPES[type_name].file_type),
        (a + "context_length", U32, shape.context_length),
        (a + "embedding_length", U32, shape.n_embd),
        (a + "block_count", U32, n_layers),
        (a + "feed_forward_length", U32, shape.n_ff),
        (a + "attention.head_count", U32, shape.n_heads),
        (a + "attention.head_count_kv", U32, shape.n_kv_heads),
        *heads,
        *window,
        *experts,
        (a + "rope.dimension_count", U32, shape.head_size),
        (a + "rope.freq_base", F32, shape.rope_freq_base),
        (a + "attention.layer_norm_rms_epsilon", F32, shape.rms_eps),
        (a + "vocab_size", U32, shape.n_vocab),
        ("tokenizer.ggml.model", STRING, "gpt2"),
        ("tokenizer.ggml.pre", STRING, shape.pre),
        ("tokenizer.ggml.bos_token_id", U32, BOS_ID),
        ("tokenizer.ggml.eos_token_id", U32, EOS_ID),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
    ]


def padding(offset):
    return (ALIGNMENT - offset % ALIGNMENT) % ALIGNMENT


def write_unique_rows(f, pools, plan):
    """The tensor row by row, each a slice of its stride's reordered pool (row_stride)."""
    size = plan.qtype.block_bytes
    per_row = blocks_per_row(plan)
    row_bytes = per_row * size
    assert per_row <= POOL_BLOCKS
    for row in range(plan.ne[1]):
        buffer = pools.strided_buffer(plan.pool, size, row_stride(row))
        start = (plan.phase + row * per_row) % POOL_BLOCKS * size
        f.write(buffer[start:start + row_bytes])


def write_model(path, shape_name, type_name, n_layers=None, sliding_window=None):
    """Writes the model; returns (tensor plans, bytes written).

    sliding_window, when given, replaces the shape's (0: no window key, every layer global).
    Raises ValueError, before opening `path`, when the type cannot hold the shape.
    """
    shape = SHAPES[shape_name]
    if sliding_window is not None:
        shape = dataclasses.replace(shape, sliding_window=sliding_window)
    n_layers = shape.n_layers if n_layers is None else n_layers
    plans = tensor_plans(shape, TYPES[type_name], n_layers, shape_name)
    keys = metadata(shape_name, shape, type_name, n_layers)
    tokens, types, merges = vocabulary(shape.n_vocab, CONTROL_TOKENS)
    pools = Pools()
    with open(path, "wb", buffering=WRITE_BYTES) as f:
        w = Writer(f)
        w.raw(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(plans), len(keys) + 3))
        for key, gtype, value in keys:
            w.kv(key, gtype, value)
        w.array("tokenizer.ggml.tokens", STRING, tokens)
        w.array("tokenizer.ggml.token_type", I32, types)
        w.array("tokenizer.ggml.merges", STRING, merges)
        offset = 0
        for plan in plans:
            w.string(plan.name)
            w.raw(struct.pack("<I", len(plan.ne)) + struct.pack(f"<{len(plan.ne)}Q", *plan.ne))
            w.raw(struct.pack("<IQ", plan.qtype.ggml_type, offset))
            offset += tensor_bytes(plan)
            offset += padding(offset)
        w.raw(bytes(padding(f.tell())))
        for plan in plans:
            if plan.unique_rows:
                write_unique_rows(f, pools, plan)
                w.raw(bytes(padding(tensor_bytes(plan))))
                continue
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
    ap.add_argument("--sliding-window", type=int,
                    help="the attention window of the shape's windowed layers, 0 for none "
                         "(a full-attention control of the same weights)")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    args = ap.parse_args()
    if args.layers is not None and not 1 <= args.layers <= SHAPES[args.shape].n_layers:
        ap.error(f"--layers takes 1 to {SHAPES[args.shape].n_layers}")
    start = time.monotonic()
    try:
        plans, size = write_model(args.out, args.shape, args.type, args.layers,
                                  args.sliding_window)
    except ValueError as e:
        ap.error(str(e))
    seconds = time.monotonic() - start
    counts = collections.Counter(p.qtype.name for p in plans)
    print(f"wrote {args.out}: {args.shape} {args.type}, {len(plans)} tensors "
          f"({', '.join(f'{n} {t}' for t, n in sorted(counts.items()))}), "
          f"{size / 1e9:.2f} GB in {seconds:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
