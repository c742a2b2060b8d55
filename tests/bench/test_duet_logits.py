"""duet-logits against llama.cpp's greedy decode of the tiny models.

tests/golden/tiny_models.json holds, for each tiny model, llama.cpp's greedy
path (the prompt in one batch, then one token per decode step) and the full
logits of every step. duet-logits, given the prompt and that path with
--prompt set to the prompt's length, computes each generated token as Duet's
generation does: its top two at every step must be llama.cpp's, with
llama.cpp's log-probabilities (the log-softmax of the golden logits) to the
golden's rounding. This is what bench/greedy_margins.py reads.

Run by ctest with DUET_LOGITS naming the binary.
"""
import json
import math
import os
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The golden's logits have 5 decimals. The F16 model's are further off: the
# F16 products round differently (llama.cpp's own batch and decode paths
# differ there by 6.6e-4, the golden's greedy_vs_teacher_forced figure).
TOLERANCE = {"F16": 1e-3}
DEFAULT_TOLERANCE = 2e-5


def log_softmax(row):
    top = max(row)
    log_sum = top + math.log(sum(math.exp(x - top) for x in row))
    return [x - log_sum for x in row]


class DuetLogitsTest(unittest.TestCase):
    def test_top_two_along_llama_cpp_greedy_path(self):
        with open(os.path.join(ROOT, "tests/golden/tiny_models.json")) as f:
            golden = json.load(f)
        checked = 0
        for m in golden["models"]:
            with self.subTest(model=m["file"]):
                n_prompt = m["greedy_prefix_len"]
                ids = m["ids"][:n_prompt] + m["greedy"][:-1]
                out = subprocess.run(
                    [os.environ["DUET_LOGITS"], "-m",
                     os.path.join(ROOT, golden["model_dir"], m["file"]), "--ids", json.dumps(ids),
                     "--prompt", str(n_prompt), "--from", str(n_prompt - 1), "--top", "2", "-t",
                     "1"], capture_output=True, text=True, timeout=120)
                self.assertEqual(out.returncode, 0, out.stderr)
                rows = json.loads(out.stdout)["rows"]
                self.assertEqual(len(rows), len(m["greedy"]))
                for step, (row, token, logits) in enumerate(
                        zip(rows, m["greedy"], m["greedy_logits"])):
                    want = log_softmax(logits)
                    self.assertEqual(row[0][0], token, f"step {step}")
                    for token_id, logprob in row:
                        self.assertAlmostEqual(logprob, want[token_id],
                                               delta=TOLERANCE.get(m["dtype"], DEFAULT_TOLERANCE),
                                               msg=f"step {step}, token {token_id}")
                checked += 1
        self.assertGreater(checked, 4)

    def test_bad_input_is_one_line_error(self):
        model = os.path.join(ROOT, "tests/fixtures/tiny/tiny_q8_0_gqa_untied.gguf")
        for ids, why in (("[1, 2", "parse"), ("[1, 2]", "past")):
            out = subprocess.run([os.environ["DUET_LOGITS"], "-m", model, "--ids", ids, "--from",
                                  "5"], capture_output=True, text=True, timeout=60)
            self.assertEqual(out.returncode, 1, out.stderr)
            self.assertIn(why, out.stderr)


if __name__ == "__main__":
    sys.exit(unittest.main())
