"""GGUF metadata and a byte-level BPE vocabulary, written with the standard library only
(tests/gpu/synthetic_model.py's file writer)."""
import struct

# GGUF metadata value types.
U32, I32, F32, BOOL, STRING, ARRAY = 4, 5, 6, 7, 8, 9


def byte_level_char(b):
    """GPT-2's byte-to-character table (byte-level BPE token spelling)."""
    printable = list(range(0x21, 0x7f)) + list(range(0xa1, 0xad)) + list(range(0xae, 0x100))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


# The one merge: " t" (as "Ġ" "t"), whose result is a token of its own.
MERGE = (byte_level_char(ord(" ")), "t")


def vocabulary(n_vocab, control_tokens):
    """(tokens, token types, merges): control tokens, byte tokens, the merge's token, fillers."""
    tokens = control_tokens + [byte_level_char(b) for b in range(256)] + ["".join(MERGE)]
    tokens += [f"<syn{i}>" for i in range(len(tokens), n_vocab)]
    types = [3] * len(control_tokens) + [1] * (n_vocab - len(control_tokens))  # control, normal
    return tokens, types, [" ".join(MERGE)]


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
