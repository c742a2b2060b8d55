#!/usr/bin/env python3
"""Make the greedy-decoding / logits golden file for SmolLM2 from llama.cpp.

Writes tests/golden/smollm2_greedy.json.  For 8 varied prompts (narrative,
factual question, Python, C, Chinese, a list, a ~100-token paragraph and a raw
ChatML chat turn), tokenized with add_bos = tokenizer.ggml.add_bos_token (False
for SmolLM2) and special=True:

  * free-running greedy decoding: feed the prompt, then repeatedly take the
    argmax of the last logits (np.argmax, lowest id wins ties; no sampler chain)
    and feed it, for up to 64 tokens or until an end-of-generation token (which
    is included in generated_ids);
  * teacher-forced logits: reset, evaluate prompt_ids + generated_ids in one
    batch, and for every position i (whose logits predict token i+1) record the
    top 32 ids/logits (sorted by logit descending, then id ascending), 32 other
    ids drawn with numpy default_rng(seed=[case_index, i]) from the rest of the
    vocabulary (sorted ascending) with their logits, and margin = top1 - top2;
  * consistency: whether the teacher-forced argmax at each generated position
    equals the free-running token (differences are batch-vs-incremental effects
    inside the reference itself), and the largest |logit| difference between the
    incremental and the batched evaluation;
  * free_running_steps: the top 16 ids/logits of each incremental decode step
    (one token per llama_decode call), i.e. what chose generated_ids[j].

Logits are rounded to 5 decimals.  Reference: llama-cpp-python 0.3.36 on CPU,
flash attention disabled, F16 KV cache (see golden_util.REFERENCE_SETTINGS).

Run (paths default relative to the repository root):

    python3 tests/golden/make_model_golden.py \
        [--model models/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out tests/golden/smollm2_greedy.json] [--max-new 64]

Deterministic and rerunnable on the same machine; llama.cpp's CPU kernels may
pick different SIMD paths on other CPUs, so compare with tolerances.
"""
import sys

import numpy as np

from golden_util import (eog_ids, golden_arguments, golden_header, reference_llama, repo_path,
                         round5, write_golden)

GENERATOR = "tests/golden/make_model_golden.py"
N_TOP = 32
N_SAMPLE = 32
N_FREE_TOP = 16

LONG_PARAGRAPH = (
    "The lighthouse keeper had lived alone on the island for nearly twenty years. Every evening "
    "he climbed the one hundred and twelve steps of the tower, trimmed the wick, polished the great "
    "lens, and watched the beam sweep across the dark water. Ships rarely passed anymore; most "
    "captains trusted their satellite receivers more than an old man's lamp. Still, he kept the "
    "light burning, because his father had done so before him, and because one stormy night in "
    "November a small fishing boat had found its way home by that light alone. That night, as the "
    "wind began to rise, he noticed something strange on the horizon:"
)

PROMPTS = [
    ("narrative", "Once upon a time"),
    ("factual_question", "Question: What is the boiling point of water at sea level in degrees Celsius?\nAnswer:"),
    ("python_code", "def fibonacci(n):"),
    ("c_code", "#include <stdio.h>\n\nint main(void) {\n"),
    ("chinese", "中国的首都是"),
    ("list", "Here is a list of the planets in our solar system:\n1. Mercury\n2."),
    ("long_paragraph", LONG_PARAGRAPH),
    ("chat_chatml", "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"),
]


def top_order(row, k):
    """Indices of the k largest logits, by logit descending then id ascending."""
    cand = np.argpartition(-row, k + 64)[: k + 64]  # generous candidate set
    kth = np.sort(row[cand])[::-1][k - 1]
    cand = np.nonzero(row >= kth)[0]  # everything tied with the k-th too
    order = np.lexsort((cand, -row[cand]))
    return cand[order][:k]


def main():
    ap = golden_arguments(__doc__, "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "tests/golden/smollm2_greedy.json")
    ap.add_argument("--max-new", type=int, default=64)
    args = ap.parse_args()
    model = repo_path(args.model)

    llm, settings = reference_llama(model)
    n_vocab = llm.n_vocab()
    eog = eog_ids(llm)
    eog_set = set(eog)
    add_bos = bool(llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")

    cases = []
    summary = []
    for ci, (name, text) in enumerate(PROMPTS):
        prompt_ids = [int(t) for t in llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)]

        # Free-running greedy, one token at a time after the prompt.
        llm.reset()
        llm.eval(prompt_ids)
        generated = []
        incr_logits = []  # logits that chose each generated token
        while len(generated) < args.max_new:
            row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            tok = int(np.argmax(row))
            incr_logits.append(row.copy())
            generated.append(tok)
            if tok in eog_set:
                break
            llm.eval([tok])

        # Teacher-forced: everything in one batch.
        full = prompt_ids + generated
        llm.reset()
        llm.eval(full)
        scores = np.array(llm.scores[: len(full)], dtype=np.float32)

        positions = []
        for i in range(len(full)):
            row = scores[i]
            top = top_order(row, N_TOP)
            mask = np.ones(n_vocab, dtype=bool)
            mask[top] = False
            rest = np.nonzero(mask)[0]
            rng = np.random.default_rng(seed=[ci, i])
            samp = np.sort(rng.choice(rest, size=N_SAMPLE, replace=False))
            positions.append({
                "pos": i,
                "top_ids": [int(t) for t in top],
                "top_logits": round5(row[top]),
                "sample_ids": [int(t) for t in samp],
                "sample_logits": round5(row[samp]),
                "margin": round5([row[top[0]] - row[top[1]]])[0],
            })

        # Teacher-forced argmax at generated positions vs free-running tokens.
        p = len(prompt_ids)
        mismatches = []
        max_abs = 0.0
        for j, tok in enumerate(generated):
            row = scores[p - 1 + j]
            tf = int(np.argmax(row))
            max_abs = max(max_abs, float(np.max(np.abs(row - incr_logits[j]))))
            if tf != tok:
                mismatches.append({"gen_index": j, "pos": p - 1 + j, "free_running": tok,
                                   "teacher_forced": tf,
                                   "tf_logit_diff": round5([row[tf] - row[tok]])[0]})
        # Logits of the incremental (one token per decode) path that chose each token.
        free_steps = []
        for j, row in enumerate(incr_logits):
            top = top_order(row, N_FREE_TOP)
            free_steps.append({"gen_index": j, "pos": p - 1 + j,
                               "top_ids": [int(t) for t in top],
                               "top_logits": round5(row[top]),
                               "margin": round5([row[top[0]] - row[top[1]]])[0]})
        cases.append({
            "name": name,
            "prompt": text,
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "generated_text": llm.detokenize(generated, special=True).decode("utf-8", errors="replace"),
            "stopped_on_eog": bool(generated and generated[-1] in eog_set),
            "free_vs_teacher_forced_mismatches": mismatches,
            "free_vs_teacher_forced_max_abs_logit_diff": round5([max_abs])[0],
            "positions": positions,
            "free_running_steps": free_steps,
        })
        margins = [q["margin"] for q in positions]
        summary.append((name, len(prompt_ids), len(generated), len(mismatches), max_abs,
                        sum(m < 0.05 for m in margins), len(margins), min(margins)))

    doc = {
        **golden_header(GENERATOR, model),
        "settings": settings,
        "add_bos": add_bos,
        "tokenize": "llm.tokenize(prompt.encode('utf-8'), add_bos=add_bos, special=True)",
        "n_vocab": int(n_vocab),
        "eog_ids": eog,
        "max_new_tokens": args.max_new,
        "greedy": "np.argmax over the logits of the last position (lowest id on ties); no sampler chain",
        "positions_note": ("positions[i] holds the logits computed at token i of prompt_ids+generated_ids "
                           "(evaluated in one batch), i.e. the prediction for token i+1"),
        "n_top": N_TOP,
        "n_sample": N_SAMPLE,
        "sample_rng": "numpy.random.default_rng(seed=[case_index, pos]).choice(ids not in top_ids, 32, replace=False), sorted",
        "free_running_steps_note": ("free_running_steps[j]: top 16 ids/logits of the incremental decode "
                                    "step (one token per llama_decode) that produced generated_ids[j]; "
                                    "llama.cpp's single-token path differs numerically from its batched "
                                    "path, see free_vs_teacher_forced_max_abs_logit_diff"),
        "logit_decimals": 5,
        "cases": cases,
    }
    write_golden(args.out, doc)
    print("case prompt_len gen_len mismatches max_abs_incr_vs_batch margins<0.05/positions min_margin", file=sys.stderr)
    for s in summary:
        print("%s %d %d %d %.5f %d/%d %.5f" % s, file=sys.stderr)


if __name__ == "__main__":
    main()
