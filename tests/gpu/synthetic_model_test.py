#!/usr/bin/env python3
"""The synthetic model generator (tests/gpu/synthetic_model.py), every type and shape.

For each weight type and shape: the generator runs under `python3 -S` (no
site packages, so nothing beyond the standard library can be imported); the
file parses back with the reader below, written from the GGUF layout and not
from the generator, into the shape's metadata (architecture keys, file type,
tokens and the one merge) and tensors (names, shapes, types, Qwen2's biases),
and a sample of every tensor's blocks (first, last and a few between) holds
the bytes the generator meant to write; `duet generate --model FILE -n 4`
loads it and generates. The large shapes are written with one or two layers.

Independently of the generator: the Q4_K_M tensor types against llama.cpp's
rule worked by hand for 1 to 32 layers, each type's block values (decoded
with the reference dequantizers below, written from ggml's block layouts)
against a standard deviation of 1 / sqrt(fan_in), and the weight counts of
the full shapes against the published models'.

Environment: DUET_BINARY (the `duet` executable).
"""
import math
import mmap
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_model as sm  # noqa: E402

SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}
STRING_TYPE, ARRAY_TYPE = 8, 9
F32, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 0, 2, 3, 6, 8, 12, 13, 14  # ggml types
BLOCK_BYTES = {F32: (1, 4), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q8_0: (32, 34),
               Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}  # ggml type: elements, bytes
FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q4_k": 14, "q4_k_m": 15, "q5_k": 16,
              "q6_k": 18}  # llama_ftype


class GgufReader:
    """The header, metadata and tensor infos of a GGUF file (v2/v3, little-endian).

    The file is mapped, not read: blocks are read where they are asked for.
    """

    def __init__(self, path):
        with open(path, "rb") as f:
            self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0
        magic, self.version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", self.data)
        assert magic == b"GGUF", magic
        self.pos = 24
        self.metadata = {}
        for _ in range(n_kv):
            key = self.string()
            self.metadata[key] = self.value(self.u32())
        self.tensors = {}
        for _ in range(n_tensors):
            name = self.string()
            n_dims = self.u32()
            ne = struct.unpack_from(f"<{n_dims}Q", self.data, self.pos)
            self.pos += 8 * n_dims
            ggml_type = self.u32()
            offset = struct.unpack_from("<Q", self.data, self.pos)[0]
            self.pos += 8
            self.tensors[name] = (tuple(ne), ggml_type, offset)
        alignment = self.metadata.get("general.alignment", 32)
        self.data_offset = self.pos + (alignment - self.pos % alignment) % alignment

    def u32(self):
        value = struct.unpack_from("<I", self.data, self.pos)[0]
        self.pos += 4
        return value

    def string(self):
        n = struct.unpack_from("<Q", self.data, self.pos)[0]
        self.pos += 8
        s = self.data[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s

    def value(self, gtype):
        if gtype == STRING_TYPE:
            return self.string()
        if gtype == ARRAY_TYPE:
            element_type = self.u32()
            n = struct.unpack_from("<Q", self.data, self.pos)[0]
            self.pos += 8
            return [self.value(element_type) for _ in range(n)]
        fmt = SCALAR_FORMATS[gtype]
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def block(self, name, index):
        """Bytes of block `index` of tensor `name`."""
        _, ggml_type, offset = self.tensors[name]
        size = BLOCK_BYTES[ggml_type][1]
        start = self.data_offset + offset + index * size
        return self.data[start:start + size]

    def floats(self, name):
        ne, ggml_type, offset = self.tensors[name]
        assert ggml_type == F32, (name, ne, ggml_type)
        return struct.unpack_from(f"<{math.prod(ne)}f", self.data, self.data_offset + offset)


def f16(block, offset):
    return struct.unpack_from("<e", block, offset)[0]


def scale_min_k4(j, q):
    """ggml's get_scale_min_k4: the 6-bit scale and min of Q4_K sub-block j."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def dequantize(ggml_type, block):
    """One block's values, as ggml's dequantize_row_* computes them (ggml-common.h layouts)."""
    if ggml_type == Q4_0:  # half d; qs[16]: d * (q - 8), low nibbles elements 0..15
        d, qs = f16(block, 0), block[2:18]
        return [d * ((b & 15) - 8) for b in qs] + [d * ((b >> 4) - 8) for b in qs]
    if ggml_type == Q4_1:  # half d, m; qs[16]: d * q + m
        d, m, qs = f16(block, 0), f16(block, 2), block[4:20]
        return [d * (b & 15) + m for b in qs] + [d * (b >> 4) + m for b in qs]
    if ggml_type == Q5_0:  # half d; qh (32 fifth bits); qs[16]: d * (q - 16)
        d, qh, qs = f16(block, 0), struct.unpack_from("<I", block, 2)[0], block[6:22]
        return ([d * ((b & 15 | (qh >> j & 1) << 4) - 16) for j, b in enumerate(qs)]
                + [d * ((b >> 4 | (qh >> (j + 16) & 1) << 4) - 16) for j, b in enumerate(qs)])
    if ggml_type == Q8_0:  # half d; int8 qs[32]: d * q
        d = f16(block, 0)
        return [d * q for q in struct.unpack_from("<32b", block, 2)]
    if ggml_type == Q4_K:  # half d, dmin; scales[12]; qs[128]
        d, dmin, scales, qs = f16(block, 0), f16(block, 2), block[4:16], block[16:144]
        y = []
        for j in range(4):  # 32 bytes of qs: 64 values, sub-blocks 2j (low) and 2j + 1 (high)
            sc1, m1 = scale_min_k4(2 * j, scales)
            sc2, m2 = scale_min_k4(2 * j + 1, scales)
            q = qs[32 * j:32 * j + 32]
            y += [d * sc1 * (b & 15) - dmin * m1 for b in q]
            y += [d * sc2 * (b >> 4) - dmin * m2 for b in q]
        return y
    if ggml_type == Q5_K:  # Q4_K's, then qh[32] before qs[128]: bit s of qh[l] adds 16
        d, dmin, scales = f16(block, 0), f16(block, 2), block[4:16]
        qh, qs = block[16:48], block[48:176]
        y = []
        for j in range(4):
            sc1, m1 = scale_min_k4(2 * j, scales)
            sc2, m2 = scale_min_k4(2 * j + 1, scales)
            q = qs[32 * j:32 * j + 32]
            y += [d * sc1 * ((b & 15) | (qh[l] >> (2 * j) & 1) << 4) - dmin * m1
                  for l, b in enumerate(q)]
            y += [d * sc2 * ((b >> 4) | (qh[l] >> (2 * j + 1) & 1) << 4) - dmin * m2
                  for l, b in enumerate(q)]
        return y
    if ggml_type == Q6_K:  # ql[128]; qh[64]; int8 scales[16]; half d (last)
        ql, qh = block[0:128], block[128:192]
        sc = struct.unpack_from("<16b", block, 192)
        d = f16(block, 208)
        y = [0.0] * 256
        for n in range(2):  # 128 values each
            for l in range(32):
                i = l // 16
                a, b, h = ql[64 * n + l], ql[64 * n + 32 + l], qh[32 * n + l]
                q1 = ((a & 0xF) | ((h >> 0) & 3) << 4) - 32
                q2 = ((b & 0xF) | ((h >> 2) & 3) << 4) - 32
                q3 = ((a >> 4) | ((h >> 4) & 3) << 4) - 32
                q4 = ((b >> 4) | ((h >> 6) & 3) << 4) - 32
                y[128 * n + l] = d * sc[8 * n + i] * q1
                y[128 * n + l + 32] = d * sc[8 * n + i + 2] * q2
                y[128 * n + l + 64] = d * sc[8 * n + i + 4] * q3
                y[128 * n + l + 96] = d * sc[8 * n + i + 6] * q4
        return y
    raise ValueError(f"ggml type {ggml_type}")


def sample_blocks(n_blocks):
    return sorted({0, 1, n_blocks // 3, n_blocks // 2, n_blocks - 2, n_blocks - 1} - {-1})


def q4_k_m_layers(n_layers):
    """The layers whose attn_v and ffn_down llama.cpp's Q4_K_M makes Q6_K, worked by hand
    from its use_more_bits (src/llama-quant.cpp)."""
    return {
        1: {0},
        2: {1},
        8: {0, 3, 6, 7},
        16: {0, 1, 4, 7, 10, 13, 14, 15},
        28: {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27},
        32: {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31},
    }[n_layers]


class SyntheticModelTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.duet = os.environ.get("DUET_BINARY")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_generator(self, shape, type_name, layers, name=""):
        path = os.path.join(self.tmp.name, f"{shape}-{type_name}{name}.gguf")
        command = [sys.executable, "-S", sm.__file__, "--shape", shape, "--type", type_name,
                   "--out", path]
        if layers is not None:
            command += ["--layers", str(layers)]
        return path, subprocess.run(command, capture_output=True, text=True, timeout=120)

    def generate(self, shape, type_name, layers, name=""):
        path, done = self.run_generator(shape, type_name, layers, name)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("wrote", done.stderr)
        return path

    def check_file(self, path, shape_name, type_name, layers):
        """Returns the reader, every check passed."""
        shape = sm.SHAPES[shape_name]
        n_layers = shape.n_layers if layers is None else layers
        gguf = GgufReader(path)
        m = gguf.metadata
        arch = shape.architecture
        self.assertEqual(gguf.version, 3)
        self.assertEqual(m["general.architecture"], arch)
        self.assertEqual(m["general.name"], f"synthetic {shape_name} {type_name}")
        self.assertEqual(m[arch + ".block_count"], n_layers)
        self.assertEqual(m[arch + ".embedding_length"], shape.n_embd)
        self.assertEqual(m[arch + ".feed_forward_length"], shape.n_ff)
        self.assertEqual(m[arch + ".attention.head_count"], shape.n_heads)
        self.assertEqual(m[arch + ".attention.head_count_kv"], shape.n_kv_heads)
        self.assertEqual(m[arch + ".context_length"], shape.context_length)
        self.assertEqual(m[arch + ".rope.freq_base"], shape.rope_freq_base)
        self.assertAlmostEqual(m[arch + ".attention.layer_norm_rms_epsilon"], shape.rms_eps)
        self.assertEqual(m["general.file_type"], FILE_TYPES[type_name])
        self.assertEqual(m["tokenizer.ggml.pre"], shape.pre)
        tokens = m["tokenizer.ggml.tokens"]
        self.assertEqual(len(tokens), shape.n_vocab)
        self.assertEqual(len(set(tokens)), shape.n_vocab)
        self.assertEqual(len(m["tokenizer.ggml.token_type"]), shape.n_vocab)
        # One merge, " t", whose halves and result are all tokens (llama.cpp
        # refuses a BPE vocabulary without merges).
        self.assertEqual(m["tokenizer.ggml.merges"], ["\u0120 t"])
        self.assertTrue({"\u0120", "t", "\u0120t"} <= set(tokens))

        n_per_layer = (9 + (3 if shape.qkv_bias else 0) + (2 if shape.qk_norm else 0)
                       + (1 if shape.n_experts else 0))  # the router, and 3-D experts
        self.assertEqual(len(gguf.tensors), 2 + n_per_layer * n_layers + (0 if shape.tied else 1))
        self.assertEqual("output.weight" in gguf.tensors, not shape.tied)
        for i in range(n_layers):
            for b in ("attn_q.bias", "attn_k.bias", "attn_v.bias"):
                self.assertEqual(f"blk.{i}.{b}" in gguf.tensors, shape.qkv_bias)
            for n in ("attn_q_norm.weight", "attn_k_norm.weight"):
                self.assertEqual(f"blk.{i}.{n}" in gguf.tensors, shape.qk_norm)
        self.assertEqual(m.get(arch + ".attention.key_length"), shape.head_dim or None)
        self.assertEqual(m.get(arch + ".attention.value_length"), shape.head_dim or None)
        self.assertEqual(m[arch + ".rope.dimension_count"], shape.head_size)
        self.assertEqual(m.get(arch + ".expert_count"), shape.n_experts or None)
        self.assertEqual(m.get(arch + ".expert_used_count"), shape.n_experts_used or None)
        self.assertEqual(m.get(arch + ".expert_feed_forward_length"), shape.n_ff_exp or None)
        self.assertEqual(gguf.tensors["blk.0.attn_q.weight"][0][1], shape.n_heads * shape.head_size)
        plans = sm.tensor_plans(shape, sm.TYPES[type_name], n_layers)
        self.assertEqual(sorted(gguf.tensors), sorted(p.name for p in plans))
        pools = sm.Pools()
        end = 0
        for plan in plans:
            ne, ggml_type, offset = gguf.tensors[plan.name]
            self.assertEqual(ne, plan.ne, plan.name)
            self.assertEqual(ggml_type, plan.qtype.ggml_type, plan.name)
            # F32: the vectors, and a mixture's router.
            self.assertEqual(ggml_type == F32, len(ne) == 1 or "gate_inp" in plan.name, plan.name)
            self.assertEqual(offset % 32, 0, plan.name)
            elements, block_bytes = BLOCK_BYTES[ggml_type]
            self.assertEqual(ne[0] % elements, 0, plan.name)
            n_blocks = math.prod(ne) // elements
            end = max(end, gguf.data_offset + offset + n_blocks * block_bytes)
            for i in sample_blocks(n_blocks):
                self.assertEqual(gguf.block(plan.name, i), sm.expected_block(pools, plan, i),
                                 f"{plan.name} block {i}")
        self.assertLessEqual(end, len(gguf.data))
        self.assertLess(len(gguf.data) - end, 32)  # no more than the final padding
        # Neighbouring rows of a matrix differ (the pool does not repeat with them).
        q_name = "blk.0.attn_q.weight"
        row_blocks = gguf.tensors[q_name][0][0] // BLOCK_BYTES[gguf.tensors[q_name][1]][0]
        self.assertNotEqual(gguf.block(q_name, 0), gguf.block(q_name, row_blocks))
        # A norm weight reads back as numbers near 1, a bias as numbers near 0.
        norm = gguf.floats("output_norm.weight")
        self.assertTrue(all(0.3 < x < 1.7 for x in norm), norm[:8])
        if shape.qkv_bias:
            bias = gguf.floats("blk.0.attn_k.bias")
            self.assertEqual(len(bias), shape.n_kv_heads * shape.n_embd // shape.n_heads)
            self.assertTrue(all(abs(x) < 1 for x in bias), bias[:8])
            self.assertGreater(max(abs(x) for x in bias), 0.01)
        return gguf

    def types(self, gguf):
        return {name: t for name, (_, t, _) in gguf.tensors.items()}

    def run_duet(self, path, shape_name):
        if not self.duet:
            self.skipTest("DUET_BINARY is not set")
        done = subprocess.run([self.duet, "generate", "--model", path, "-n", "4", "--threads",
                               "2", "--prompt", "Once upon a time, the"],
                              capture_output=True, text=True, timeout=240)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("synthetic " + shape_name, done.stderr)

    def test_q4_0_whole_shape(self):
        path = self.generate("smollm2-135m", "q4_0", None)
        self.check_file(path, "smollm2-135m", "q4_0", None)
        self.run_duet(path, "smollm2-135m")

    def test_q4_1_two_layers(self):
        path = self.generate("smollm2-135m", "q4_1", 2)
        self.check_file(path, "smollm2-135m", "q4_1", 2)
        self.run_duet(path, "smollm2-135m")

    def test_q8_0_two_layers(self):
        path = self.generate("smollm2-135m", "q8_0", 2)
        self.check_file(path, "smollm2-135m", "q8_0", 2)
        self.run_duet(path, "smollm2-135m")

    def test_k_quants_fall_back_on_576(self):
        """As llama.cpp: rows of 576 cannot hold K-quants; Q6_K becomes Q8_0 and Q4_K Q5_0
        (Gemma 3's type), while ffn_down's 1536 keeps its K-quant."""
        for type_name, k_quant, fallback in (("q6_k", Q6_K, Q8_0), ("q4_k", Q4_K, Q5_0)):
            path = self.generate("smollm2-135m", type_name, 1)
            gguf = self.check_file(path, "smollm2-135m", type_name, 1)
            for name, t in self.types(gguf).items():
                expected = F32 if "norm" in name else k_quant if "ffn_down" in name else fallback
                self.assertEqual(t, expected, name)
            self.run_duet(path, "smollm2-135m")

    def test_q4_k_q5_k_and_q6_k_plans(self):
        """q4_k, q5_k and q6_k put every matrix in their type where the rows allow it."""
        for shape_name in ("llama3.2-1b", "qwen2.5-7b", "llama3-8b"):
            shape = sm.SHAPES[shape_name]
            for type_name, ggml_type in (("q4_k", Q4_K), ("q5_k", Q5_K), ("q6_k", Q6_K)):
                keys = {k: v for k, _, v in sm.metadata(shape_name, shape, type_name, 2)}
                self.assertEqual(keys["general.file_type"], FILE_TYPES[type_name])
                for p in sm.tensor_plans(shape, sm.TYPES[type_name], 2):
                    self.assertEqual(p.qtype.ggml_type, F32 if len(p.ne) == 1 else ggml_type,
                                     (shape_name, p.name))

    def test_llama3_2_1b_q5_k_one_layer(self):
        path = self.generate("llama3.2-1b", "q5_k", 1)
        gguf = self.check_file(path, "llama3.2-1b", "q5_k", 1)
        for name, t in self.types(gguf).items():
            self.assertEqual(t, F32 if "norm" in name else Q5_K, name)
        self.run_duet(path, "llama3.2-1b")

    def test_llama3_2_1b_q4_k_m_two_layers(self):
        """Tied: token_embd is the output head, so Q6_K; attn_v and ffn_down Q6_K in layer 1."""
        path = self.generate("llama3.2-1b", "q4_k_m", 2)
        gguf = self.check_file(path, "llama3.2-1b", "q4_k_m", 2)
        types = self.types(gguf)
        self.assertEqual(types["token_embd.weight"], Q6_K)
        for name, t in types.items():
            if name.startswith("blk.1.") and ("attn_v" in name or "ffn_down" in name):
                self.assertEqual(t, Q6_K, name)
            elif name != "token_embd.weight":
                self.assertEqual(t, F32 if "norm" in name else Q4_K, name)
        self.run_duet(path, "llama3.2-1b")

    def test_qwen2_5_7b_q4_k_m_one_layer(self):
        """Untied: output Q6_K, token_embd Q4_K; biases F32; `qwen2.` keys."""
        path = self.generate("qwen2.5-7b", "q4_k_m", 1)
        gguf = self.check_file(path, "qwen2.5-7b", "q4_k_m", 1)
        self.assertNotIn("llama.block_count", gguf.metadata)
        types = self.types(gguf)
        self.assertEqual(types["output.weight"], Q6_K)
        self.assertEqual(types["token_embd.weight"], Q4_K)
        self.assertEqual(types["blk.0.attn_v.weight"], Q6_K)
        self.assertEqual(types["blk.0.ffn_down.weight"], Q6_K)
        self.assertEqual(types["blk.0.attn_q.weight"], Q4_K)
        self.assertEqual(types["blk.0.attn_q.bias"], F32)
        self.assertEqual(gguf.tensors["blk.0.attn_q.bias"][0], (3584,))
        self.assertEqual(gguf.tensors["blk.0.attn_v.bias"][0], (512,))
        self.run_duet(path, "qwen2.5-7b")

    def test_q4_k_m_layer_choice(self):
        """attn_v and ffn_down are Q6_K exactly in llama.cpp's use_more_bits layers."""
        for shape_name, n_layers in (("llama3.2-1b", 1), ("llama3.2-1b", 2), ("llama3.2-1b", 8),
                                     ("llama3.2-1b", 16), ("qwen2.5-7b", 28), ("llama3-8b", 32)):
            shape = sm.SHAPES[shape_name]
            plans = sm.tensor_plans(shape, sm.TYPES["q4_k_m"], n_layers)
            for role in ("attn_v", "ffn_down"):
                lifted = {i for i in range(n_layers)
                          if next(p for p in plans if p.name == f"blk.{i}.{role}.weight")
                          .qtype.ggml_type == Q6_K}
                self.assertEqual(lifted, q4_k_m_layers(n_layers), (shape_name, n_layers, role))
            others = {p.qtype.ggml_type for p in plans if p.qtype.ggml_type != F32
                      and p.name not in ("token_embd.weight", "output.weight")
                      and p.name.split(".")[-2] not in ("attn_v", "ffn_down")}
            self.assertEqual(others, {Q4_K}, shape_name)
            by_name = {p.name: p.qtype.ggml_type for p in plans}
            self.assertEqual(by_name["token_embd.weight"], Q6_K if shape.tied else Q4_K)
            self.assertEqual(by_name.get("output.weight", Q6_K), Q6_K)

    def test_block_statistics(self):
        """Each type's pool blocks decode to values of sd ~1/sqrt(fan_in), mean ~0, in range."""
        for ggml_type in (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K):
            for fan_in in (2048, 18944):
                pool = sm.Pools().pool((ggml_type, fan_in))
                size = BLOCK_BYTES[ggml_type][1]
                self.assertEqual(len(pool), sm.POOL_BLOCKS * size)
                blocks = [pool[i * size:(i + 1) * size] for i in range(0, sm.POOL_BLOCKS, 17)]
                values = [x for b in blocks for x in dequantize(ggml_type, b)]
                mean = sum(values) / len(values)
                sd = math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
                sigma = 1 / math.sqrt(fan_in)
                self.assertLess(abs(sd / sigma - 1), 0.1, (ggml_type, fan_in, sd, sigma))
                self.assertLess(abs(mean), 0.05 * sigma, (ggml_type, fan_in, mean))
                for b in blocks:
                    if ggml_type in (Q4_K, Q5_K):
                        self.assertGreater(f16(b, 0), 0)
                        self.assertGreater(f16(b, 2), 0)
                        for j in range(8):
                            sc, m = scale_min_k4(j, b[4:16])
                            self.assertTrue(0 < sc < 64 and 0 <= m < 64, (sc, m))
                    if ggml_type == Q6_K:
                        self.assertGreater(f16(b, 208), 0)
                        scales = struct.unpack_from("<16b", b, 192)
                        self.assertTrue(all(-127 <= s <= 127 and s != 0 for s in scales), scales)
                    if ggml_type == Q8_0:
                        self.assertNotIn(-128, struct.unpack_from("<32b", b, 2))

    def test_q4_k_scale_packing(self):
        """pack_q4_k_scales is the inverse of ggml's get_scale_min_k4 over the 6-bit range."""
        rng = random.Random(7)
        for _ in range(200):
            sc = [rng.randrange(64) for _ in range(8)]
            m = [rng.randrange(64) for _ in range(8)]
            packed = sm.pack_q4_k_scales(sc, m)
            self.assertEqual([scale_min_k4(j, packed) for j in range(8)], list(zip(sc, m)))
        with self.assertRaises(AssertionError):
            sm.pack_q4_k_scales([64] + [0] * 7, [0] * 8)

    def test_qwen3_0_6b_q4_k_m_one_layer(self):
        path = self.generate("qwen3-0.6b", "q4_k_m", 1)
        gguf = self.check_file(path, "qwen3-0.6b", "q4_k_m", 1)
        self.assertEqual(len(gguf.floats("blk.0.attn_q_norm.weight")), 128)
        self.run_duet(path, "qwen3-0.6b")

    def test_mixtures_of_experts_one_layer(self):
        for shape_name in ("qwen3moe-30b-a3b", "mixtral-8x7b"):
            shape = sm.SHAPES[shape_name]
            path = self.generate(shape_name, "q4_0", 1)
            gguf = self.check_file(path, shape_name, "q4_0", 1)
            ne, ggml_type, _ = gguf.tensors["blk.0.ffn_down_exps.weight"]
            self.assertEqual(ne, (shape.expert_ff, shape.n_embd, shape.n_experts))
            self.assertEqual(gguf.tensors["blk.0.ffn_gate_inp.weight"][:2],
                             ((shape.n_embd, shape.n_experts), F32))
            router = gguf.floats("blk.0.ffn_gate_inp.weight")
            self.assertTrue(0.1 < max(abs(x) for x in router) * math.sqrt(shape.n_embd) < 10)
            self.run_duet(path, shape_name)
            os.remove(path)
        done = self.run_generator("qwen3moe-30b-a3b", "q4_k_m", 1, "-mix")[1]
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("mix for experts is not modelled", done.stderr)

    def test_token_rows_never_repeat(self):
        """No two tokens share a row of token_embd (tied here): a pool read straight through
        would repeat every POOL_BLOCKS rows, giving tokens t and t + 4,099 the same logit."""
        path = self.generate("smollm2-135m", "q8_0", 1, "-rows")
        gguf = GgufReader(path)
        ne, ggml_type, _ = gguf.tensors["token_embd.weight"]
        per_row = ne[0] // BLOCK_BYTES[ggml_type][0]
        rows = set()
        for r in range(ne[1]):
            rows.add(b"".join(gguf.block("token_embd.weight", r * per_row + j)
                              for j in range(per_row)))
        self.assertEqual(len(rows), ne[1])
        self.assertGreater(ne[1], 4 * sm.POOL_BLOCKS)

    def test_same_bytes_every_time(self):
        a = self.generate("smollm2-135m", "q8_0", 1, "-a")
        with open(a, "rb") as f:
            first = f.read()
        b = self.generate("smollm2-135m", "q8_0", 1, "-b")
        with open(b, "rb") as f:
            self.assertEqual(first, f.read())

    def test_full_shape_plans(self):
        """The full shapes' tensors add up to the published models' weight counts."""
        for shape_name, n_weights, n_tensors in (("llama3-8b", 8030261248, 291),
                                                 ("llama3.2-1b", 1235814400, 146),
                                                 ("qwen2.5-7b", 7615616512, 339),
                                                 ("qwen3-0.6b", 596049920, 310),
                                                 ("qwen3-8b", 8190735360, 399),
                                                 ("qwen3moe-30b-a3b", 30532122624, 579),
                                                 ("mixtral-8x7b", 46702792704, 323)):
            shape = sm.SHAPES[shape_name]
            for type_name in ("q4_0",) if shape.n_experts else ("q4_0", "q4_k_m"):
                plans = sm.tensor_plans(shape, sm.TYPES[type_name], shape.n_layers)
                self.assertEqual(sum(math.prod(p.ne) for p in plans), n_weights, shape_name)
                self.assertEqual(len(plans), n_tensors, shape_name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
