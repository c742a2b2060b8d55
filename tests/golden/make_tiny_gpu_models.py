#!/usr/bin/env python3
"""Make tiny random GGUF models of the shapes the CUDA backend runs (head_dim 64).

Writes tests/fixtures/tiny_gpu/*.gguf. The tiny fixtures of make_tiny_models.py
and make_tiny_shape_models.py have 16-dimension heads, which the GPU's attention
kernel does not run; those of make_tiny_kquant_models.py are one layer of mostly
K-quants (F16 on the GPU); the default model is too large to travel everywhere a
GPU check runs. These give the GPU checks (tests/gpu/model_check.cpp,
tests/gpu/tp_check.cpp) models in the GEMV's native types, of two layers, that
split over two GPUs. They are compared with Duet's CPU forward, itself tested
against llama.cpp, so no golden logits come with them.

Hyper-parameters: n_embd 256, n_layer 2, n_head 4, head_dim 64, n_ff 512,
context_length 256, rms eps 1e-5, freq_base 10000, the 299-token GPT-2 byte-level
vocabulary of make_tiny_models.py; random normal weights with std 1/sqrt(fan_in),
norm weights 1 + 0.1*N(0,1), 1-D tensors F32. What differs:

    name                      n_head_kv  matrices  output   what it adds
    tiny_gpu_q8_0_gqa_tied    2          Q8_0      tied     two KV heads: splits over 2 GPUs
    tiny_gpu_q4_1_gqa_untied  2          Q4_1      output   the 4-bit GEMV path, a separate head

Each model draws its weights from numpy default_rng(seed=[20261, model_index]).

Run (paths default relative to the repository root):

    python3 tests/golden/make_tiny_gpu_models.py [--out-dir tests/fixtures/tiny_gpu]

Deterministic and rerunnable: the .gguf files are byte-identical between runs.
"""
import argparse
import os

import numpy as np

from golden_util import repo_path
from make_tiny_models import BOS_ID, EOS_ID, FILE_TYPE, MERGES, N_CTX_TRAIN, RMS_EPS, build_vocab

N_EMBD = 256
N_LAYER = 2
N_HEAD = 4
HEAD_DIM = 64
N_FF = 512

MODELS = [
    ("tiny_gpu_q8_0_gqa_tied", dict(n_head_kv=2, weight_type="Q8_0", tied=True)),
    ("tiny_gpu_q4_1_gqa_untied", dict(n_head_kv=2, weight_type="Q4_1", tied=False)),
]


def tensor_plan(o):
    """(name, numpy shape or None for (n_vocab, n_embd), fan_in, kind) in llama.cpp order."""
    q = N_HEAD * HEAD_DIM
    kv = o["n_head_kv"] * HEAD_DIM
    plan = [("token_embd.weight", None, N_EMBD, "matrix")]
    for i in range(N_LAYER):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (N_EMBD,), None, "norm"),
            (p + "attn_q.weight", (q, N_EMBD), N_EMBD, "matrix"),
            (p + "attn_k.weight", (kv, N_EMBD), N_EMBD, "matrix"),
            (p + "attn_v.weight", (kv, N_EMBD), N_EMBD, "matrix"),
            (p + "attn_output.weight", (N_EMBD, q), q, "matrix"),
            (p + "ffn_norm.weight", (N_EMBD,), None, "norm"),
            (p + "ffn_gate.weight", (N_FF, N_EMBD), N_EMBD, "matrix"),
            (p + "ffn_up.weight", (N_FF, N_EMBD), N_EMBD, "matrix"),
            (p + "ffn_down.weight", (N_EMBD, N_FF), N_FF, "matrix"),
        ]
    plan.append(("output_norm.weight", (N_EMBD,), None, "norm"))
    if not o["tied"]:
        plan.append(("output.weight", None, N_EMBD, "matrix"))
    return plan


def write_model(path, index, name, o, tokens, types):
    import gguf
    from gguf.quants import quantize

    n_vocab = len(tokens)
    rng = np.random.default_rng(seed=[20261, index])
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(name)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(o["n_head_kv"])
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPE[o["weight_type"]])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for tname, shape, fan_in, kind in tensor_plan(o):
        if shape is None:
            shape = (n_vocab, N_EMBD)
        if kind == "norm":
            w.add_tensor(tname, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            continue
        data = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        gtype = gguf.GGMLQuantizationType[o["weight_type"]]
        w.add_tensor(tname, quantize(data, gtype), raw_dtype=gtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=repo_path("tests/fixtures/tiny_gpu"))
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    tokens, types = build_vocab()
    for index, (name, o) in enumerate(MODELS):
        path = os.path.join(args.out_dir, name + ".gguf")
        write_model(path, index, name, o, tokens, types)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
