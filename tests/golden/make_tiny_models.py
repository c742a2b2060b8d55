#!/usr/bin/env python3
"""Make tiny random Llama-architecture GGUF models and their llama.cpp logits.

Writes tests/fixtures/tiny/tiny_*.gguf and tests/golden/tiny_models.json.

Models (all: n_embd 64, n_layer 2, n_head 4, head_dim 16, n_ff 128,
context_length 256, rope freq_base 10000, rms eps 1e-5, norm weights F32):

    name                     weights              n_head_kv  output
    tiny_f32_gqa_tied        F32                  2 (GQA)    tied
    tiny_f16_mha_tied        F16                  4 (MHA)    tied
    tiny_q8_0_mha_untied     Q8_0                 4          output.weight
    tiny_q8_0_gqa_untied     Q8_0                 2          output.weight
    tiny_q4_0_gqa_untied     Q4_0                 2          output.weight
    tiny_q4_0_mha_tied       Q4_0                 4          tied
    tiny_q4_1_mha_untied     Q4_1                 4          output.weight
    tiny_q4_1_gqa_tied       Q4_1                 2          tied
    tiny_mixed_gqa_tied      token_embd Q8_0,     2          tied (like SmolLM2's Q4_1 file)
                             other matrices Q4_1

Weights are random normal with std 1/sqrt(fan_in) (token_embd and output use
1/sqrt(n_embd)); norm weights are 1 + 0.1*N(0,1); each model has its own seed
(numpy default_rng(seed=[20240, model_index])).  Quantization uses
gguf.quants.quantize (bit-compatible with ggml's quantize_row_*_ref).  Q and K
are written as drawn: the `llama` architecture's adjacent-pair RoPE applies.

The vocabulary is a small GPT-2 byte-level BPE vocabulary: ids 0..2 are the
control tokens <|endoftext|>, <|im_start|>, <|im_end|>; ids 3..258 are the 256
byte-alphabet tokens (byte value b -> id 3 + b, GPT-2 bytes_to_unicode
spelling); ids 259.. are the results of 40 merges of common English pairs
(GPT-2's first merges).  tokenizer.ggml.model "gpt2", pre "gpt-2" (llama.cpp's spelling),
add_bos false, bos = <|endoftext|>, eos = <|im_end|>.

For every model the golden file holds (reference: llama-cpp-python 0.3.36, CPU,
flash attention disabled, F16 KV cache, see golden_util.REFERENCE_SETTINGS):
  * ids: 24 token ids (random, no control tokens, from numpy
    default_rng(seed=[777, model_index, attempt]) with the first attempt whose
    greedy run below has top1-top2 margins >= 0.05 at every step) and logits[i][v] for
    every position i (evaluated in one batch, logits_all; position i predicts
    token i+1), full vocabulary, rounded to 5 decimals;
  * greedy: 16 tokens of free-running greedy decoding (np.argmax, lowest id on
    ties, one token per llama_decode; it does not stop on end-of-generation
    tokens) after evaluating ids[:8] in one batch, with the full logits of every
    step (greedy_logits[j] chose greedy[j]);
and the file holds a few tokenizer checks of the tiny vocabulary.

Run (paths default relative to the repository root):

    python3 tests/golden/make_tiny_models.py \
        [--out-dir tests/fixtures/tiny] [--golden tests/golden/tiny_models.json]

Deterministic and rerunnable: the .gguf files are byte-identical between runs.
"""
import argparse
import os
import sys

import numpy as np

from golden_util import (FORMAT_VERSION, REFERENCE, eog_ids, reference_llama, repo_path,
                         round5, sha256_file, write_json)

GENERATOR = "tests/golden/make_tiny_models.py"

N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
HEAD_DIM = 16
N_FF = 128
N_CTX_TRAIN = 256
ROPE_BASE = 10000.0
RMS_EPS = 1e-5
N_IDS = 24
N_PREFIX = 8
N_GREEDY = 16
GREEDY_MIN_MARGIN = 0.05

# (name, dtype of matrices, token_embd dtype, n_head_kv, tied)
MODELS = [
    ("tiny_f32_gqa_tied", "F32", "F32", 2, True),
    ("tiny_f16_mha_tied", "F16", "F16", 4, True),
    ("tiny_q8_0_mha_untied", "Q8_0", "Q8_0", 4, False),
    ("tiny_q8_0_gqa_untied", "Q8_0", "Q8_0", 2, False),
    ("tiny_q4_0_gqa_untied", "Q4_0", "Q4_0", 2, False),
    ("tiny_q4_0_mha_tied", "Q4_0", "Q4_0", 4, True),
    ("tiny_q4_1_mha_untied", "Q4_1", "Q4_1", 4, False),
    ("tiny_q4_1_gqa_tied", "Q4_1", "Q4_1", 2, True),
    ("tiny_mixed_gqa_tied", "Q4_1", "Q8_0", 2, True),
]

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID = 0, 2

# GPT-2's first 40 merges (rank order).
MERGES = [
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t",
    "Ġ w", "Ġ o", "e n", "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b",
    "e d", "Ġ f", "in g", "Ġ p", "o u", "Ġa n", "a l", "a r", "Ġt o", "Ġ m",
    "Ġo f", "Ġ in", "Ġ d", "Ġ h", "Ġan d", "i c", "a s", "l e", "Ġt h", "i on",
]

TOKENIZER_CHECKS = [
    "the cat sat on the mat",
    "Hello, world! and then, in the end...",
    "<|im_start|>user\nhi<|im_end|>\n",
    "caf\u00e9 \u4f60\u597d 42\t\n",
]


def bytes_to_unicode():
    """GPT-2's byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) \
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_vocab():
    b2u = bytes_to_unicode()
    tokens = list(CONTROL_TOKENS) + [b2u[b] for b in range(256)]
    types = [3] * len(CONTROL_TOKENS) + [1] * 256  # 3 = CONTROL, 1 = NORMAL
    known = set(tokens)
    for m in MERGES:
        a, b = m.split(" ")
        assert a in known and b in known, m
        t = a + b
        assert t not in known, t
        tokens.append(t)
        types.append(1)
        known.add(t)
    return tokens, types


def tensor_plan(n_head_kv, tied):
    """(name, numpy shape = (rows, row_len), fan_in, is_norm) in llama.cpp order."""
    plan = [("token_embd.weight", None, N_EMBD, False)]
    kv = n_head_kv * HEAD_DIM
    for i in range(N_LAYER):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (N_EMBD,), None, True),
            (p + "attn_q.weight", (N_HEAD * HEAD_DIM, N_EMBD), N_EMBD, False),
            (p + "attn_k.weight", (kv, N_EMBD), N_EMBD, False),
            (p + "attn_v.weight", (kv, N_EMBD), N_EMBD, False),
            (p + "attn_output.weight", (N_EMBD, N_HEAD * HEAD_DIM), N_HEAD * HEAD_DIM, False),
            (p + "ffn_norm.weight", (N_EMBD,), None, True),
            (p + "ffn_gate.weight", (N_FF, N_EMBD), N_EMBD, False),
            (p + "ffn_up.weight", (N_FF, N_EMBD), N_EMBD, False),
            (p + "ffn_down.weight", (N_EMBD, N_FF), N_FF, False),
        ]
    plan.append(("output_norm.weight", (N_EMBD,), None, True))
    if not tied:
        plan.append(("output.weight", None, N_EMBD, False))
    return plan


FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama_ftype


def write_model(path, index, name, mat_type, embd_type, n_head_kv, tied, tokens, types):
    import gguf
    from gguf.quants import quantize

    n_vocab = len(tokens)
    rng = np.random.default_rng(seed=[20240, index])
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPE[mat_type])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # llama.cpp spelling; "gpt2" is rejected
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    tensors = []
    for tname, shape, fan_in, is_norm in tensor_plan(n_head_kv, tied):
        if shape is None:
            shape = (n_vocab, N_EMBD)
        if is_norm:
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            qtype = "F32"
        else:
            data = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
            qtype = embd_type if tname == "token_embd.weight" else mat_type
        gtype = gguf.GGMLQuantizationType[qtype]
        q = quantize(data, gtype)
        if qtype in ("F32", "F16"):
            w.add_tensor(tname, q)
        else:
            w.add_tensor(tname, q, raw_dtype=gtype)
        tensors.append({"name": tname, "type": qtype, "ne": list(shape[::-1])})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="tests/fixtures/tiny")
    ap.add_argument("--golden", default="tests/golden/tiny_models.json")
    args = ap.parse_args()
    out_dir = repo_path(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    import llama_cpp

    tokens, types = build_vocab()
    n_vocab = len(tokens)
    models = []
    settings = None
    tok_checks = None
    for index, (name, mat_type, embd_type, n_head_kv, tied) in enumerate(MODELS):
        fname = name + ".gguf"
        path = os.path.join(out_dir, fname)
        tensors = write_model(path, index, name, mat_type, embd_type, n_head_kv, tied, tokens, types)

        llm, settings = reference_llama(path)
        assert llm.n_vocab() == n_vocab
        eog = eog_ids(llm)

        # Draw ids until the greedy run has no near ties (margin >= GREEDY_MIN_MARGIN at
        # every step), so that greedy comparisons are robust to small numeric differences.
        for attempt in range(1000):
            rng = np.random.default_rng(seed=[777, index, attempt])
            ids = [int(t) for t in rng.integers(len(CONTROL_TOKENS), n_vocab, size=N_IDS)]
            llm.reset()
            llm.eval(ids[:N_PREFIX])
            greedy, greedy_logits, greedy_margins = [], [], []
            for _ in range(N_GREEDY):
                row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                tok = int(np.argmax(row))
                greedy.append(tok)
                greedy_logits.append(round5(row))
                srow = np.sort(row)
                greedy_margins.append(float(srow[-1] - srow[-2]))
                llm.eval([tok])
            if min(greedy_margins) >= GREEDY_MIN_MARGIN:
                break
        else:
            raise RuntimeError(f"{name}: no id sequence with greedy margins >= {GREEDY_MIN_MARGIN}")

        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:N_IDS], dtype=np.float32)

        # Teacher-forced check of the greedy run (batch vs one-token decode).
        seq = ids[:N_PREFIX] + greedy
        llm.reset()
        llm.eval(seq)
        tf = np.array(llm.scores[: len(seq)], dtype=np.float32)
        tf_rows = tf[N_PREFIX - 1: N_PREFIX - 1 + N_GREEDY]
        gl = np.array(greedy_logits, dtype=np.float32)
        greedy_tf_max_abs = float(np.max(np.abs(tf_rows - gl)))
        greedy_tf_mismatch = [j for j in range(N_GREEDY) if int(np.argmax(tf_rows[j])) != greedy[j]]

        if tok_checks is None:
            tok_checks = [{"text": t, "ids": [int(x) for x in
                                              llm.tokenize(t.encode("utf-8"), add_bos=False, special=True)]}
                          for t in TOKENIZER_CHECKS]
        srt = np.sort(logits, axis=1)
        margins = srt[:, -1] - srt[:, -2]
        models.append({
            "file": fname,
            "sha256": sha256_file(path),
            "dtype": "mixed" if mat_type != embd_type else mat_type,
            "token_embd_type": embd_type,
            "matrix_type": mat_type,
            "layout": ("gqa" if n_head_kv < N_HEAD else "mha") + ("_tied" if tied else "_untied"),
            "n_head_kv": n_head_kv,
            "tied_embeddings": tied,
            "eog_ids": eog,
            "tensors": tensors,
            "ids_seed": [777, index, attempt],
            "ids": ids,
            "logits": [round5(r) for r in logits],
            "min_margin": round5([margins.min()])[0],
            "greedy_prefix_len": N_PREFIX,
            "greedy": greedy,
            "greedy_logits": greedy_logits,
            "greedy_margins": round5(greedy_margins),
            "greedy_vs_teacher_forced_max_abs_logit_diff": round5([greedy_tf_max_abs])[0],
            "greedy_vs_teacher_forced_argmax_mismatches": greedy_tf_mismatch,
        })
        print(f"{fname}: {os.path.getsize(path)} bytes, eog={eog}, min margin {margins.min():.4f}, "
              f"greedy {greedy}, incr-vs-batch max|d| {greedy_tf_max_abs:.2e}, "
              f"mismatches {greedy_tf_mismatch}", file=sys.stderr)
        llm.close()
        del llm

    doc = {
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "reference": REFERENCE,
        "reference_version": llama_cpp.__version__,
        "settings": settings,
        "model_dir": args.out_dir,
        "hparams": {"n_embd": N_EMBD, "n_layer": N_LAYER, "n_head": N_HEAD, "head_dim": HEAD_DIM,
                    "n_ff": N_FF, "context_length": N_CTX_TRAIN, "rope_freq_base": ROPE_BASE,
                    "rms_norm_eps": RMS_EPS, "n_vocab": n_vocab, "architecture": "llama"},
        "vocab": {"model": "gpt2", "pre": "gpt-2", "add_bos": False, "bos_id": BOS_ID, "eos_id": EOS_ID,
                  "control_tokens": CONTROL_TOKENS, "n_merges": len(MERGES)},
        "tokenizer_checks": tok_checks,
        "logits_note": ("logits[i] = logits at position i of ids evaluated in one batch "
                        "(prediction for token i+1), full vocabulary"),
        "greedy_note": ("evaluate ids[:greedy_prefix_len] in one batch, then 16 steps of argmax "
                        "(lowest id on ties) fed back one token per decode; no stop on EOG; "
                        "greedy_logits[j] = full logits that chose greedy[j]"),
        "greedy_min_margin": GREEDY_MIN_MARGIN,
        "logit_decimals": 5,
        "models": models,
    }
    write_json(repo_path(args.golden), doc)
    print(f"wrote {args.golden}", file=sys.stderr)


if __name__ == "__main__":
    main()
