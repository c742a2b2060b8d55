#!/usr/bin/env python3
"""Make tiny random Llama GGUF models with BF16, Q4_K, Q5_K, Q6_K and Q5_0 weights and their llama.cpp logits.

Writes tests/fixtures/tiny_kquant/tiny_*.gguf and tests/golden/tiny_kquant_models.json.

The models reuse tests/golden/make_tiny_models.py (its vocabulary, tensor plan,
weight distribution and writer) with other dimensions: K-quant rows must be
multiples of 256 (llama.cpp's quantizer silently falls back to Q5_0/Q8_0
otherwise), so the K-quant models have n_embd 256 and n_ff 512 (head_dim 64),
and one layer to keep each file under 600 KB (two layers would take 0.7-1.0 MB).
BF16 takes 2 bytes a weight and needs no multiple of 256, so its model is smaller.

    name                   n_embd n_ff n_head_kv output  weights
    tiny_q4_k_mha_untied   256    512  4         separate Q4_K everywhere (output too)
    tiny_q6_k_gqa_tied     256    512  2         tied     Q6_K everywhere
    tiny_bf16_mha_tied     128    256  4         tied     BF16 everywhere
    tiny_mixed_gqa_tied    256    512  2         tied     token_embd Q6_K, attn_q Q4_K, attn_k BF16,
                                                          attn_v Q6_K, attn_output Q8_0,
                                                          ffn_gate/ffn_up Q4_K, ffn_down Q6_K
    tiny_q5_0_gqa_untied   256    512  2         separate Q5_0 everywhere (Gemma 3's type, and
                                                          Q4_K's fallback for rows not of 256)
    tiny_q5_k_gqa_untied   256    512  2         separate Q5_K everywhere (Q5_K_M's main type;
                                                          token_embd and output named, as
                                                          llama-quantize's Q5_K_S would not)

All: n_layer 1, n_head 4, context_length 256, rope base 10000, rms eps 1e-5, norm
weights F32. Weights are drawn as in make_tiny_models.py (seed [20240, 100 + model
index]), written as F32 and then quantized by llama.cpp itself
(llama_model_quantize, one thread, pure: every matrix gets the requested type,
no importance matrix), so the blocks are llama.cpp's reference quantization.

Reference (llama-cpp-python 0.3.36, CPU, flash attention off, F16 KV cache;
golden_util.REFERENCE_SETTINGS). By default llama.cpp computes K-quant matrix
products of 8 or more activation rows with its own tiled kernels
(ggml-cpu/tiled) and repacks Q4_K matrices whose row count is a multiple of 8
into an interleaved layout (ggml-cpu/repack.cpp); both accumulate in other
orders than its vec_dot kernels. The primary logits therefore come from
llama.cpp with both off (GGML_CPU_TILED_MM=0, use_extra_bufts = false), where
every product is ggml_vec_dot_q4_K_q8_K / ggml_vec_dot_q6_K_q8_K. (Duet
followed their AVX2 order until its K-quants took the tiled kernels' order:
one exact integer per super-block; either order rounds well inside the
logits' 5 decimals.) BF16 products go through tinyBLAS's vdpbf16ps on this CPU
(Duet's order) where the weight has a multiple of 4 rows and there are 2 or
more activation rows, else through ggml_vec_dot_bf16 (another order: the
299-row output head of the BF16 model differs in the last bits). llama.cpp's
default run (a separate process, as the variable is read once) is compared
too: its largest difference is stored, and its logits where they differ
(logits_default).

For every model: ids (24 random token ids, the first draw whose greedy run has
top1-top2 margins >= 0.05), logits[i][v] at every position (one batch,
logits_all, 5 decimals), greedy (16 tokens of greedy decoding after ids[:8],
one token per decode), and the file's tensor types.

Run from anywhere (paths default relative to the repository root):

    python3 tests/golden/make_tiny_kquant_models.py \
        [--out-dir tests/fixtures/tiny_kquant] [--golden tests/golden/tiny_kquant_models.json]

Deterministic: rerunning writes byte-identical .gguf files.
"""
import argparse
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import make_tiny_models as tiny
from golden_util import (FORMAT_VERSION, REFERENCE, eog_ids, reference_llama, repo_path, round5,
                         sha256_file, write_json)

GENERATOR = "tests/golden/make_tiny_kquant_models.py"

N_LAYER = 1
SEED_BASE = 100  # weights seed [20240, SEED_BASE + model index], apart from make_tiny_models.py's

# llama_ftype values (llama.h) and ggml types (gguf.GGMLQuantizationType numbering).
FTYPE_Q5_0, FTYPE_Q4_K_S, FTYPE_Q5_K_S, FTYPE_Q6_K, FTYPE_BF16 = 8, 14, 16, 18, 32
GGML = {"F32": 0, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}

# (name, n_embd, n_ff, n_head_kv, tied, ftype, token_embd type or None, [(regex, type)])
MODELS = [
    ("tiny_q4_k_mha_untied", 256, 512, 4, False, FTYPE_Q4_K_S, None, []),
    ("tiny_q6_k_gqa_tied", 256, 512, 2, True, FTYPE_Q6_K, None, []),
    ("tiny_bf16_mha_tied", 128, 256, 4, True, FTYPE_BF16, None, []),
    ("tiny_mixed_gqa_tied", 256, 512, 2, True, FTYPE_Q4_K_S, "Q6_K",
     [("attn_k", "BF16"), ("attn_v", "Q6_K"), ("attn_output", "Q8_0"), ("ffn_down", "Q6_K")]),
    ("tiny_q5_0_gqa_untied", 256, 512, 2, False, FTYPE_Q5_0, None, []),
    ("tiny_q5_k_gqa_untied", 256, 512, 2, False, FTYPE_Q5_K_S, "Q5_K", [("output", "Q5_K")]),
]


def set_dimensions(n_embd, n_ff):
    """make_tiny_models.py's tensor plan reads its module constants: set ours."""
    tiny.N_EMBD = n_embd
    tiny.N_FF = n_ff
    tiny.HEAD_DIM = n_embd // tiny.N_HEAD
    tiny.N_LAYER = N_LAYER


def quantize(f32_path, out_path, ftype, embd_type, overrides):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 1
    params.ftype = ftype
    params.pure = True
    if embd_type is not None:
        params.token_embedding_type = GGML[embd_type]
    keep = []
    if overrides:
        arr = (llama_cpp.llama_model_tensor_override * (len(overrides) + 1))()
        for i, (pattern, qtype) in enumerate(overrides):
            keep.append(pattern.encode())
            arr[i].pattern = keep[-1]
            arr[i].type = GGML[qtype]
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
        keep.append(arr)
    rc = llama_cpp.llama_model_quantize(f32_path.encode(), out_path.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed for {out_path}: {rc}")


@contextlib.contextmanager
def no_repacking():
    """Load models with use_extra_bufts = false (no repacked weight layouts)."""
    import llama_cpp.llama_cpp as lib

    original = lib.llama_model_default_params

    def patched():
        p = original()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = patched
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def tensor_types(path):
    import gguf

    reader = gguf.GGUFReader(path)
    return [{"name": t.name, "type": t.tensor_type.name, "ne": [int(n) for n in t.shape]}
            for t in reader.tensors]


def batch_logits(llm, ids):
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def draw_ids(llm, index, n_vocab):
    """ids and greedy run, as make_tiny_models.py draws them (seed [777, 100 + index, attempt])."""
    for attempt in range(1000):
        rng = np.random.default_rng(seed=[777, SEED_BASE + index, attempt])
        ids = [int(t) for t in rng.integers(len(tiny.CONTROL_TOKENS), n_vocab, size=tiny.N_IDS)]
        llm.reset()
        llm.eval(ids[: tiny.N_PREFIX])
        greedy, margins = [], []
        for _ in range(tiny.N_GREEDY):
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            tok = int(np.argmax(row))
            greedy.append(tok)
            srow = np.sort(row)
            margins.append(float(srow[-1] - srow[-2]))
            llm.eval([tok])
        if min(margins) >= tiny.GREEDY_MIN_MARGIN:
            return ids, [777, SEED_BASE + index, attempt], greedy, margins
    raise RuntimeError(f"model {index}: no id sequence with greedy margins >= {tiny.GREEDY_MIN_MARGIN}")


def default_logits(path, ids):
    """Batch logits from llama.cpp's defaults (tiled K-quant kernels, repacking), in a child process."""
    env = dict(os.environ)
    env.pop("GGML_CPU_TILED_MM", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--default-logits", path,
                          ",".join(str(i) for i in ids)], env=env, check=True, capture_output=True, text=True)
    return np.array(json.loads(out.stdout), dtype=np.float32)


def tiled_logits(path, ids):
    """Batch logits with every K-quant product in llama.cpp's tiled kernels (forced, no repacking),
    whose order Duet follows, in a child process."""
    env = dict(os.environ, GGML_CPU_TILED_MM="1", GGML_CPU_TILED_MM_FORCE="1")
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--tiled-logits", path,
                          ",".join(str(i) for i in ids)], env=env, check=True, capture_output=True, text=True)
    return np.array(json.loads(out.stdout), dtype=np.float32)


def print_default_logits(path, ids, repacking=True):
    if repacking:
        llm, _ = reference_llama(path)
    else:
        with no_repacking():
            llm, _ = reference_llama(path)
    print(json.dumps(batch_logits(llm, ids).tolist()))
    llm.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="tests/fixtures/tiny_kquant")
    ap.add_argument("--golden", default="tests/golden/tiny_kquant_models.json")
    ap.add_argument("--default-logits", nargs=2, metavar=("MODEL", "IDS"), help=argparse.SUPPRESS)
    ap.add_argument("--tiled-logits", nargs=2, metavar=("MODEL", "IDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.default_logits:
        print_default_logits(args.default_logits[0], [int(i) for i in args.default_logits[1].split(",")])
        return
    if args.tiled_logits:
        print_default_logits(args.tiled_logits[0], [int(i) for i in args.tiled_logits[1].split(",")],
                             repacking=False)
        return
    # Read once, at llama.cpp's first matrix product: set before any model runs here.
    os.environ["GGML_CPU_TILED_MM"] = "0"
    out_dir = repo_path(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    import llama_cpp

    tokens, types = tiny.build_vocab()
    n_vocab = len(tokens)
    models = []
    settings = None
    with tempfile.TemporaryDirectory() as tmp:
        for index, (name, n_embd, n_ff, n_head_kv, tied, ftype, embd_type, overrides) in enumerate(MODELS):
            set_dimensions(n_embd, n_ff)
            f32_path = os.path.join(tmp, name + ".f32.gguf")
            tiny.write_model(f32_path, SEED_BASE + index, name, "F32", "F32", n_head_kv, tied, tokens, types)
            fname = name + ".gguf"
            path = os.path.join(out_dir, fname)
            quantize(f32_path, path, ftype, embd_type, overrides)

            with no_repacking():
                llm, settings = reference_llama(path)
            settings = dict(settings, use_extra_bufts=False, GGML_CPU_TILED_MM=0)
            assert llm.n_vocab() == n_vocab
            eog = eog_ids(llm)
            ids, ids_seed, greedy, greedy_margins = draw_ids(llm, index, n_vocab)
            logits = batch_logits(llm, ids)
            llm.close()
            del llm

            defaults = default_logits(path, ids)
            default_diff = float(np.max(np.abs(defaults - logits)))
            kquant = any(t["type"] in ("Q4_K", "Q5_K", "Q6_K") for t in tensor_types(path))
            tiled = tiled_logits(path, ids) if kquant else None

            srt = np.sort(logits, axis=1)
            margins = srt[:, -1] - srt[:, -2]
            entry = {
                "file": fname,
                "sha256": sha256_file(path),
                "layout": ("gqa" if n_head_kv < tiny.N_HEAD else "mha") + ("_tied" if tied else "_untied"),
                "hparams": {"n_embd": n_embd, "n_ff": n_ff, "n_layer": N_LAYER, "n_head": tiny.N_HEAD,
                            "n_head_kv": n_head_kv, "head_dim": n_embd // tiny.N_HEAD},
                "tied_embeddings": tied,
                "eog_ids": eog,
                "tensors": tensor_types(path),
                "ids_seed": ids_seed,
                "ids": ids,
                "logits": [round5(r) for r in logits],
                "min_margin": round5([margins.min()])[0],
                "default_run_max_abs_logit_diff": round5([default_diff])[0],
                "greedy_prefix_len": tiny.N_PREFIX,
                "greedy": greedy,
                "greedy_margins": round5(greedy_margins),
            }
            if default_diff > 0.0:
                entry["logits_default"] = [round5(r) for r in defaults]
            if tiled is not None:
                entry["logits_tiled"] = [round5(r) for r in tiled]
                entry["tiled_run_max_abs_logit_diff"] = round5([float(np.max(np.abs(tiled - logits)))])[0]
            models.append(entry)
            print(f"{fname}: {os.path.getsize(path)} bytes, min margin {margins.min():.4f}, "
                  f"default run vs vec_dot run max|d| {default_diff:.2e}, "
                  f"tiled run {entry.get('tiled_run_max_abs_logit_diff', 0.0):.2e}, greedy {greedy}", file=sys.stderr)

    doc = {
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "reference": REFERENCE,
        "reference_version": llama_cpp.__version__,
        "settings": settings,
        "reference_note": ("logits and greedy: llama.cpp with GGML_CPU_TILED_MM=0 and "
                           "use_extra_bufts = false (its vec_dot kernels only); logits_default: "
                           "its default run (tiled K-quant kernels, repacked Q4_K), where it differs; "
                           "logits_tiled: every K-quant product in its tiled kernels "
                           "(GGML_CPU_TILED_MM_FORCE=1, use_extra_bufts = false), Duet's K-quant order"),
        "model_dir": args.out_dir,
        "hparams": {"n_head": tiny.N_HEAD, "context_length": tiny.N_CTX_TRAIN,
                    "rope_freq_base": tiny.ROPE_BASE, "rms_norm_eps": tiny.RMS_EPS,
                    "n_vocab": n_vocab, "architecture": "llama"},
        "logits_note": ("logits[i] = logits at position i of ids evaluated in one batch "
                        "(prediction for token i+1), full vocabulary"),
        "greedy_note": ("evaluate ids[:greedy_prefix_len] in one batch, then 16 steps of argmax "
                        "fed back one token per decode; no stop on EOG"),
        "greedy_min_margin": tiny.GREEDY_MIN_MARGIN,
        "logit_decimals": 5,
        "models": models,
    }
    write_json(repo_path(args.golden), doc)
    print(f"wrote {args.golden}", file=sys.stderr)


if __name__ == "__main__":
    main()
