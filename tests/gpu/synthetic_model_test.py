#!/usr/bin/env python3
"""The synthetic model generator (tests/gpu/synthetic_model.py) at the small shape.

For each weight type: the generator runs under `python3 -S` (no site
packages, so nothing beyond the standard library can be imported); the file
parses back with the reader below, written from the GGUF layout and not from
the generator, into the shape's metadata and tensors, and a sample of every
tensor's blocks (first, last and a few between) holds the bytes the generator
meant to write; `duet generate --model FILE -n 4` loads it and generates.

Environment: DUET_BINARY (the `duet` executable).
"""
import os
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
BLOCK_BYTES = {0: (1, 4), 2: (32, 18), 3: (32, 20), 8: (32, 34)}  # ggml type: elements, bytes


class GgufReader:
    """The header, metadata and tensor infos of a GGUF file (v2/v3, little-endian)."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.data = f.read()
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


def sample_blocks(n_blocks):
    return sorted({0, 1, n_blocks // 3, n_blocks // 2, n_blocks - 2, n_blocks - 1} - {-1})


class SyntheticModelTest(unittest.TestCase):
    shape = "smollm2-135m"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.duet = os.environ.get("DUET_BINARY")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def generate(self, type_name, layers, name=""):
        path = os.path.join(self.tmp.name, f"{self.shape}-{type_name}{name}.gguf")
        command = [sys.executable, "-S", sm.__file__, "--shape", self.shape, "--type", type_name,
                   "--out", path]
        if layers is not None:
            command += ["--layers", str(layers)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("wrote", done.stderr)
        return path

    def check_file(self, path, type_name, layers):
        shape = sm.SHAPES[self.shape]
        n_layers = shape.n_layers if layers is None else layers
        gguf = GgufReader(path)
        m = gguf.metadata
        self.assertEqual(gguf.version, 3)
        self.assertEqual(m["general.architecture"], "llama")
        self.assertEqual(m["llama.block_count"], n_layers)
        self.assertEqual(m["llama.embedding_length"], shape.n_embd)
        self.assertEqual(m["llama.feed_forward_length"], shape.n_ff)
        self.assertEqual(m["llama.attention.head_count"], shape.n_heads)
        self.assertEqual(m["llama.attention.head_count_kv"], shape.n_kv_heads)
        self.assertEqual(m["general.file_type"], sm.TYPES[type_name].file_type)
        self.assertEqual(len(m["tokenizer.ggml.tokens"]), shape.n_vocab)
        self.assertEqual(len(set(m["tokenizer.ggml.tokens"])), shape.n_vocab)
        self.assertEqual(len(m["tokenizer.ggml.token_type"]), shape.n_vocab)

        plans = sm.tensor_plans(shape, sm.TYPES[type_name], n_layers)
        self.assertEqual(sorted(gguf.tensors), sorted(p.name for p in plans))
        self.assertEqual(len(gguf.tensors), 2 + 9 * n_layers + (0 if shape.tied else 1))
        pools = sm.Pools()
        end = 0
        for plan in plans:
            ne, ggml_type, offset = gguf.tensors[plan.name]
            self.assertEqual(ne, plan.ne, plan.name)
            self.assertEqual(ggml_type, plan.qtype.ggml_type, plan.name)
            self.assertEqual(offset % 32, 0, plan.name)
            elements, block_bytes = BLOCK_BYTES[ggml_type]
            n_blocks = ne[0] * (ne[1] if len(ne) > 1 else 1) // elements
            end = max(end, gguf.data_offset + offset + n_blocks * block_bytes)
            for i in sample_blocks(n_blocks):
                self.assertEqual(gguf.block(plan.name, i), sm.expected_block(pools, plan, i),
                                 f"{plan.name} block {i}")
        self.assertLessEqual(end, len(gguf.data))
        self.assertLess(len(gguf.data) - end, 32)  # no more than the final padding
        # Neighbouring rows of a matrix differ (the pool does not repeat with them).
        q = next(p for p in plans if p.name == "blk.0.attn_q.weight")
        row_blocks = q.ne[0] // 32
        self.assertNotEqual(gguf.block(q.name, 0), gguf.block(q.name, row_blocks))
        # A norm weight reads back as numbers near 1.
        norm = struct.unpack_from(f"<{shape.n_embd}f", gguf.data,
                                  gguf.data_offset + gguf.tensors["output_norm.weight"][2])
        self.assertTrue(all(0.3 < x < 1.7 for x in norm), norm[:8])

    def run_duet(self, path):
        if not self.duet:
            self.skipTest("DUET_BINARY is not set")
        done = subprocess.run([self.duet, "generate", "--model", path, "-n", "4", "--threads",
                               "2", "--prompt", "Once upon a time"],
                              capture_output=True, text=True, timeout=120)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertIn("synthetic " + self.shape, done.stderr)

    def test_q4_0_whole_shape(self):
        path = self.generate("q4_0", None)
        self.check_file(path, "q4_0", None)
        self.run_duet(path)

    def test_q4_1_two_layers(self):
        path = self.generate("q4_1", 2)
        self.check_file(path, "q4_1", 2)
        self.run_duet(path)

    def test_q8_0_two_layers(self):
        path = self.generate("q8_0", 2)
        self.check_file(path, "q8_0", 2)
        self.run_duet(path)

    def test_same_bytes_every_time(self):
        a = self.generate("q8_0", 1, "-a")
        with open(a, "rb") as f:
            first = f.read()
        b = self.generate("q8_0", 1, "-b")
        with open(b, "rb") as f:
            self.assertEqual(first, f.read())

    def test_llama3_8b_plan(self):
        """The 8B shape's tensors add up to Llama-3-8B's 8.03 billion weights."""
        plans = sm.tensor_plans(sm.SHAPES["llama3-8b"], sm.TYPES["q4_0"], 32)
        n_weights = sum(p.ne[0] * (p.ne[1] if len(p.ne) > 1 else 1) for p in plans)
        self.assertEqual(n_weights, 8030261248)
        self.assertEqual(len(plans), 291)


if __name__ == "__main__":
    unittest.main(verbosity=2)
