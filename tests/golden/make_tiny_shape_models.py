#!/usr/bin/env python3
"""Make tiny random GGUF models of the Llama family's other shapes, and their llama.cpp logits.

Writes tests/fixtures/tiny_shapes/*.gguf and tests/golden/tiny_shapes.json.

Every model has the hyper-parameters, the vocabulary and the weight recipe of
make_tiny_models.py (n_embd 64, n_layer 2, n_head 4, head_dim 16, n_ff 128,
context_length 256, rms eps 1e-5, the 299-token GPT-2 byte-level vocabulary,
random normal weights with std 1/sqrt(fan_in), norm weights 1 + 0.1*N(0,1));
matrices and token_embd are Q8_0, 1-D tensors F32.  What differs:

    name                        architecture  n_head_kv  output   what it adds
    tiny_qwen2_gqa_tied         qwen2         2          tied     Q/K/V biases, NeoX RoPE
    tiny_qwen2_mha_untied       qwen2         4          output   Q/K/V biases, NeoX RoPE
    tiny_llama_rope_freqs       llama         2          output   rope_freqs.weight (Llama 3.1
                                                                  style divisors), freq_base 500000
    tiny_llama_rope_linear      llama         2          tied     rope.scaling.type linear,
                                                                  factor 2, freq_base 500000
    tiny_mistral_sliding_window llama         2          tied     attention.sliding_window 4096
                                                                  (Duet refuses it: no logits)
    tiny_qwen3_gqa_tied         qwen3         2          tied     heads of 64 (key_length, wider
                                                                  than n_embd / n_head = 16, and
                                                                  a size the GPU's attention
                                                                  runs), RMS norm of each Q and
                                                                  K head
    tiny_gemma3_swa_tied        gemma3        2          tied     qwen3's heads and head norms,
                                                                  norms after both blocks, gated
                                                                  GELU, the embedding times
                                                                  sqrt(n_embd) (all hard-coded by
                                                                  llama.cpp for gemma3), a sliding
                                                                  window of 8 on layer 0
                                                                  (sliding_window_pattern 2: layer
                                                                  1 global), freq_base 1e6 with
                                                                  linear scaling 8 for the global
                                                                  layer (the windowed one: 10000,
                                                                  unscaled)
    tiny_qwen3moe_tied          qwen3moe      2          tied     qwen3's heads, and in place of
                                                                  the feed-forward 8 experts of 32
                                                                  hidden units
                                                                  (expert_feed_forward_length;
                                                                  feed_forward_length stays 128),
                                                                  3 used per token
    tiny_mixtral_untied         llama         2          output   Mixtral: expert_count 4, 2 used,
                                                                  experts of feed_forward_length 64

A mixture's router (ffn_gate_inp, F32 as llama.cpp's quantizer leaves it) and its experts
(ffn_{gate,up,down}_exps, 3-D, Q8_0) draw like the other matrices.

Biases are 0.5*N(0,1) (large, like Qwen2's K bias, so they matter); the qwen2
and qwen3 files hold no rope.dimension_count (as real ones), so n_rot = head_dim.
Qwen3's and Gemma 3's per-head norm weights are 1 + 0.3*N(0,1), and a control takes them to
ones (llama.cpp loads no qwen3 file without them, so the norm itself cannot be
taken away: the logits against llama.cpp's show it is done).
Q and K are written as drawn: qwen2 rotates halves (NeoX), llama adjacent pairs.
Each model draws its weights from numpy default_rng(seed=[20250, model_index]).

For every model but the refused one the golden file holds (reference:
llama-cpp-python 0.3.36, CPU, flash attention disabled, F16 KV cache, see
golden_util.REFERENCE_SETTINGS) 24 token ids (random, no control tokens,
default_rng(seed=[778, model_index])) and logits[i][v] for every position i,
evaluated in one batch (position i predicts token i+1), full vocabulary,
rounded to 5 decimals.  To show each fixture really tests its feature, every
model also records feature_effect: the largest |logit difference| llama.cpp
finds between the model and control variants of it with the feature taken
away (biases zeroed, rope_freqs removed, scaling removed, the other RoPE
style); the script fails unless each is well above the tests' tolerance.

Run (paths default relative to the repository root):

    python3 tests/golden/make_tiny_shape_models.py \
        [--out-dir tests/fixtures/tiny_shapes] [--golden tests/golden/tiny_shapes.json]

Deterministic and rerunnable: the .gguf files are byte-identical between runs.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

from golden_util import FORMAT_VERSION, REFERENCE, reference_llama, repo_path, round5, sha256_file, write_json
from make_tiny_models import (BOS_ID, CONTROL_TOKENS, EOS_ID, FILE_TYPE, HEAD_DIM, MERGES, N_CTX_TRAIN, N_EMBD,
                              N_FF, N_HEAD, N_LAYER, RMS_EPS, build_vocab)

GENERATOR = "tests/golden/make_tiny_shape_models.py"

N_IDS = 24
WEIGHT_TYPE = "Q8_0"
BIAS_STD = 0.5
# Llama 3.1 style divisors of the RoPE frequencies, one per rotated pair (n_rot / 2 = 8):
# 1 keeps a frequency, 8 slows it eightfold. Not monotone on purpose, to catch an off-by-one.
ROPE_FREQ_FACTORS = [1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 8.0, 7.0]
MIN_FEATURE_EFFECT = 0.2  # every feature must move some logit by at least this much

# name -> options; "refuse" models are written but not run through Duet's forward.
MODELS = [
    ("tiny_qwen2_gqa_tied", dict(arch="qwen2", n_head_kv=2, tied=True, biases=True)),
    ("tiny_qwen2_mha_untied", dict(arch="qwen2", n_head_kv=4, tied=False, biases=True)),
    ("tiny_llama_rope_freqs", dict(arch="llama", n_head_kv=2, tied=False, rope_base=500000.0,
                                   rope_freqs=ROPE_FREQ_FACTORS)),
    ("tiny_llama_rope_linear", dict(arch="llama", n_head_kv=2, tied=True, rope_base=500000.0,
                                    linear_factor=2.0)),
    ("tiny_mistral_sliding_window", dict(arch="llama", n_head_kv=2, tied=True, sliding_window=4096,
                                         refuse={"kind": "unsupported", "message_contains": "sliding"})),
    ("tiny_qwen3_gqa_tied", dict(arch="qwen3", n_head_kv=2, tied=True, head_dim=64, qk_norm=True)),
    ("tiny_gemma3_swa_tied", dict(arch="gemma3", n_head_kv=2, tied=True, head_dim=64, qk_norm=True,
                                  post_norms=True, sliding_window=8, swa_pattern=2, rope_base=1000000.0,
                                  linear_factor=8.0)),
    ("tiny_qwen3moe_tied", dict(arch="qwen3moe", n_head_kv=2, tied=True, head_dim=64, qk_norm=True,
                                n_expert=8, n_expert_used=3, n_ff_exp=32)),
    ("tiny_mixtral_untied", dict(arch="llama", n_head_kv=2, tied=False, n_ff=64, n_expert=4,
                                 n_expert_used=2)),
]
QK_NORM_STD = 0.3

# Control variants: (label, option overrides) whose logits must differ from the model's.
CONTROLS = {
    "tiny_qwen2_gqa_tied": [("zero_biases", dict(zero_biases=True)),
                            ("adjacent_pair_rope", dict(arch="llama"))],
    "tiny_qwen2_mha_untied": [("zero_biases", dict(zero_biases=True)),
                              ("adjacent_pair_rope", dict(arch="llama"))],
    "tiny_llama_rope_freqs": [("no_rope_freqs", dict(rope_freqs=None))],
    "tiny_llama_rope_linear": [("no_scaling", dict(linear_factor=None))],
    "tiny_qwen3_gqa_tied": [("unit_qk_norm_weights", dict(unit_qk_norm=True))],
    "tiny_gemma3_swa_tied": [("no_sliding_window", dict(sliding_window=None)),
                             ("unit_qk_norm_weights", dict(unit_qk_norm=True)),
                             ("unit_post_norm_weights", dict(unit_post_norm=True))],
    "tiny_qwen3moe_tied": [("one_expert_used", dict(n_expert_used=1)),
                           ("two_experts_used", dict(n_expert_used=2))],
    "tiny_mixtral_untied": [("one_expert_used", dict(n_expert_used=1))],
}


def expert_ff(o):
    """Hidden units per expert: qwen3moe's own key, Mixtral's feed_forward_length."""
    return o.get("n_ff_exp") or o.get("n_ff", N_FF)


def tensor_plan(o):
    """(name, numpy shape, fan_in, kind) in llama.cpp order; kind is matrix, norm, bias or rope_freqs."""
    plan = [("token_embd.weight", None, N_EMBD, "matrix")]
    if o.get("rope_freqs"):
        plan.append(("rope_freqs.weight", (len(o["rope_freqs"]),), None, "rope_freqs"))
    head_dim = o.get("head_dim", HEAD_DIM)
    q = N_HEAD * head_dim
    kv = o["n_head_kv"] * head_dim
    for i in range(N_LAYER):
        p = f"blk.{i}."
        plan.append((p + "attn_norm.weight", (N_EMBD,), None, "norm"))
        plan.append((p + "attn_q.weight", (q, N_EMBD), N_EMBD, "matrix"))
        if o.get("biases"):
            plan.append((p + "attn_q.bias", (q,), None, "bias"))
        plan.append((p + "attn_k.weight", (kv, N_EMBD), N_EMBD, "matrix"))
        if o.get("biases"):
            plan.append((p + "attn_k.bias", (kv,), None, "bias"))
        plan.append((p + "attn_v.weight", (kv, N_EMBD), N_EMBD, "matrix"))
        if o.get("biases"):
            plan.append((p + "attn_v.bias", (kv,), None, "bias"))
        if o.get("qk_norm"):
            plan.append((p + "attn_q_norm.weight", (head_dim,), None, "qk_norm"))
            plan.append((p + "attn_k_norm.weight", (head_dim,), None, "qk_norm"))
        plan.append((p + "attn_output.weight", (N_EMBD, q), q, "matrix"))
        if o.get("post_norms"):
            plan.append((p + "post_attention_norm.weight", (N_EMBD,), None, "post_norm"))
        plan.append((p + "ffn_norm.weight", (N_EMBD,), None, "norm"))
        if o.get("n_expert"):
            n_exp, n_ff_exp = o["n_expert"], expert_ff(o)
            plan += [
                (p + "ffn_gate_inp.weight", (n_exp, N_EMBD), N_EMBD, "router"),
                (p + "ffn_gate_exps.weight", (n_exp, n_ff_exp, N_EMBD), N_EMBD, "matrix"),
                (p + "ffn_down_exps.weight", (n_exp, N_EMBD, n_ff_exp), n_ff_exp, "matrix"),
                (p + "ffn_up_exps.weight", (n_exp, n_ff_exp, N_EMBD), N_EMBD, "matrix"),
            ]
        else:
            n_ff = o.get("n_ff", N_FF)
            plan += [
                (p + "ffn_gate.weight", (n_ff, N_EMBD), N_EMBD, "matrix"),
                (p + "ffn_up.weight", (n_ff, N_EMBD), N_EMBD, "matrix"),
                (p + "ffn_down.weight", (N_EMBD, n_ff), n_ff, "matrix"),
            ]
        if o.get("post_norms"):
            plan.append((p + "post_ffw_norm.weight", (N_EMBD,), None, "post_norm"))
    plan.append(("output_norm.weight", (N_EMBD,), None, "norm"))
    if not o["tied"]:
        plan.append(("output.weight", None, N_EMBD, "matrix"))
    return plan


def write_model(path, index, name, o, tokens, types):
    """Writes one model; the random draws depend only on (index, tensor plan), so control variants
    that keep the plan (zero_biases, another architecture, other metadata) keep every weight."""
    import gguf
    from gguf.quants import quantize

    n_vocab = len(tokens)
    rng = np.random.default_rng(seed=[20250, index])
    w = gguf.GGUFWriter(path, o["arch"])
    w.add_name(name)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(o.get("n_ff", N_FF))
    if o.get("n_expert"):
        w.add_expert_count(o["n_expert"])
        w.add_expert_used_count(o["n_expert_used"])
        if o.get("n_ff_exp"):
            w.add_expert_feed_forward_length(o["n_ff_exp"])
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(o["n_head_kv"])
    if o["arch"] == "llama":
        w.add_rope_dimension_count(HEAD_DIM)
    if "head_dim" in o:
        w.add_key_length(o["head_dim"])
        w.add_value_length(o["head_dim"])
    w.add_rope_freq_base(o.get("rope_base", 10000.0))
    if o.get("linear_factor"):
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(o["linear_factor"])
    if o.get("sliding_window"):
        w.add_sliding_window(o["sliding_window"])
        if o.get("swa_pattern"):
            w.add_uint32(f"{o['arch']}.attention.sliding_window_pattern", o["swa_pattern"])
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPE[WEIGHT_TYPE])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)

    # The plan with every optional tensor, so that removing one in a control keeps the other draws.
    full = dict(o, biases=o.get("biases") or o.get("zero_biases"), rope_freqs=o.get("rope_freqs"))
    tensors = []
    for tname, shape, fan_in, kind in tensor_plan(full):
        if shape is None:
            shape = (n_vocab, N_EMBD)
        if kind == "norm":
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif kind == "bias":
            data = (BIAS_STD * rng.standard_normal(shape)).astype(np.float32)
            if o.get("zero_biases"):
                data[:] = 0.0
        elif kind == "post_norm":
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            if o.get("unit_post_norm"):
                data[:] = 1.0
        elif kind == "qk_norm":
            data = (1.0 + QK_NORM_STD * rng.standard_normal(shape)).astype(np.float32)
            if o.get("unit_qk_norm"):
                data[:] = 1.0
        elif kind == "rope_freqs":
            data = np.array(o["rope_freqs"], dtype=np.float32)
        else:
            data = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        if kind == "matrix":
            gtype = gguf.GGMLQuantizationType[WEIGHT_TYPE]
            w.add_tensor(tname, quantize(data, gtype), raw_dtype=gtype)
            qtype = WEIGHT_TYPE
        else:
            w.add_tensor(tname, data)
            qtype = "F32"
        tensors.append({"name": tname, "type": qtype, "ne": list(shape[::-1])})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def reference_logits(path, ids):
    llm, settings = reference_llama(path)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    n_vocab = llm.n_vocab()
    llm.close()
    del llm
    return logits, settings, n_vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="tests/fixtures/tiny_shapes")
    ap.add_argument("--golden", default="tests/golden/tiny_shapes.json")
    args = ap.parse_args()
    out_dir = repo_path(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    import llama_cpp

    tokens, types = build_vocab()
    n_vocab = len(tokens)
    models, refused = [], []
    settings = None
    for index, (name, o) in enumerate(MODELS):
        fname = name + ".gguf"
        path = os.path.join(out_dir, fname)
        tensors = write_model(path, index, name, o, tokens, types)
        size = os.path.getsize(path)
        assert size < 256_000, f"{fname} is {size} bytes"
        if "refuse" in o:
            # llama.cpp loads and runs it (it ignores the key for `llama`); only Duet refuses.
            reference_logits(path, [3, 4, 5])
            refused.append({"file": fname, "sha256": sha256_file(path), "architecture": o["arch"],
                            "sliding_window": o.get("sliding_window"), "error": o["refuse"]})
            print(f"{fname}: {size} bytes (Duet must refuse it)", file=sys.stderr)
            continue

        rng = np.random.default_rng(seed=[778, index])
        ids = [int(t) for t in rng.integers(len(CONTROL_TOKENS), n_vocab, size=N_IDS)]
        logits, settings, ref_vocab = reference_logits(path, ids)
        assert ref_vocab == n_vocab

        effects = {}
        with tempfile.TemporaryDirectory() as tmp:
            for label, overrides in CONTROLS[name]:
                cpath = os.path.join(tmp, f"{name}_{label}.gguf")
                write_model(cpath, index, name, dict(o, **overrides), tokens, types)
                control, _, _ = reference_logits(cpath, ids)
                effects[label] = float(np.max(np.abs(control - logits)))
                assert effects[label] >= MIN_FEATURE_EFFECT, (name, label, effects[label])

        srt = np.sort(logits, axis=1)
        margins = srt[:, -1] - srt[:, -2]
        entry = {
            "file": fname,
            "sha256": sha256_file(path),
            "architecture": o["arch"],
            "n_head_kv": o["n_head_kv"],
            "tied_embeddings": o["tied"],
            "qkv_biases": bool(o.get("biases")),
            "rope_style": "adjacent_pairs" if o["arch"] == "llama" else "halves",
            "head_dim": o.get("head_dim", HEAD_DIM),
            "qk_norm": bool(o.get("qk_norm")),
            "rope_freq_base": o.get("rope_base", 10000.0),
            "rope_scaling": {"type": "linear", "factor": o["linear_factor"]} if o.get("linear_factor") else None,
            "rope_freqs": o.get("rope_freqs"),
            "post_norms": bool(o.get("post_norms")),
            "ffn_activation": "gelu_tanh" if o["arch"] == "gemma3" else "silu",
            "sliding_window": o.get("sliding_window", 0),
            "swa_layers": ([il % o["swa_pattern"] < o["swa_pattern"] - 1 for il in range(N_LAYER)]
                           if o.get("sliding_window") else []),
            "n_experts": o.get("n_expert", 0),
            "n_experts_used": o.get("n_expert_used", 0),
            "n_ff_exp": expert_ff(o) if o.get("n_expert") else 0,
            "tensors": tensors,
            "ids_seed": [778, index],
            "ids": ids,
            "logits": [round5(r) for r in logits],
            "min_margin": round5([margins.min()])[0],
            "feature_effect": {k: round5([v])[0] for k, v in effects.items()},
        }
        models.append(entry)
        print(f"{fname}: {size} bytes, min margin {margins.min():.4f}, feature effect "
              f"{ {k: round(v, 3) for k, v in effects.items()} }", file=sys.stderr)

    doc = {
        "format_version": FORMAT_VERSION,
        "generator": GENERATOR,
        "reference": REFERENCE,
        "reference_version": llama_cpp.__version__,
        "settings": settings,
        "model_dir": args.out_dir,
        "hparams": {"n_embd": N_EMBD, "n_layer": N_LAYER, "n_head": N_HEAD, "head_dim": HEAD_DIM,
                    "n_ff": N_FF, "context_length": N_CTX_TRAIN, "rms_norm_eps": RMS_EPS, "n_vocab": n_vocab,
                    "weight_type": WEIGHT_TYPE, "bias_std": BIAS_STD},
        "logits_note": ("logits[i] = logits at position i of ids evaluated in one batch "
                        "(prediction for token i+1), full vocabulary"),
        "feature_effect_note": ("max |logit difference| between the model and llama.cpp's logits of a control "
                                "variant without the feature (same weights)"),
        "logit_decimals": 5,
        "models": models,
        "refused": refused,
    }
    write_json(repo_path(args.golden), doc)
    print(f"wrote {args.golden}", file=sys.stderr)


if __name__ == "__main__":
    main()
