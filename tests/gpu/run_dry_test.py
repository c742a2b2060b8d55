#!/usr/bin/env python3
"""tests/gpu/run.sh rehearsed on the CPU.

- `run.sh --dry-run DIR`: exits 0 and leaves exactly one archive in DIR (at
  most 20 MB) holding the steps, the probe, the generator's log and the
  summary; stdout is that summary, one screen, with a row per step in the
  run's order: the probe done, the synthetic model (a small shape) written,
  and every GPU step skipped, saying it is a dry run; nothing else stays
  behind (the synthetic model and the build folder are gone).
- `run.sh DIR` on a machine without a GPU: one line, exit 0, nothing written
  (skipped where there is a GPU).
- The summary's figures from a bench JSON with duet-cuda-bench's keys and an
  IPC line printed with ipc_kv_check's own format string (both read from
  their sources, so that a change there that the summary would miss fails
  here).
"""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import run_summary  # noqa: E402

ORDER = ["probe", "synth", "configure", "build", "ops", "matmul", "attention", "kv_rows",
         "sampling", "nccl", "model", "nccl_kv", "ipc_kv", "tp", "bench", "bench_8b", "ipc_kv_8b"]


def has_gpu():
    if not shutil.which("nvidia-smi"):
        return False
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    return done.returncode == 0 and "GPU " in done.stdout


class DryRunTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.env = dict(os.environ, DUET_BUILD_DIR=os.path.join(self.tmp.name, "build"))
        self.env.pop("DUET_GPU_DRY_RUN", None)
        self.env.pop("DUET_GPU_SYNTHETIC", None)

    def tearDown(self):
        self.tmp.cleanup()

    def run_sh(self, *args):
        return subprocess.run(["bash", os.path.join(HERE, "run.sh"), *args], capture_output=True,
                              text=True, env=self.env, timeout=240)

    def test_dry_run_packs_one_archive_and_prints_the_summary(self):
        out = os.path.join(self.tmp.name, "out")
        done = self.run_sh("--dry-run", out)
        self.assertEqual(done.returncode, 0, done.stderr)
        names = os.listdir(out)
        self.assertEqual(len(names), 1, names)
        self.assertRegex(names[0], r"^gpu-run-\d{8}-\d{6}\.tar\.gz$")
        archive = os.path.join(out, names[0])
        self.assertLessEqual(os.path.getsize(archive), 20 << 20)
        self.assertFalse(os.path.exists(self.env["DUET_BUILD_DIR"]), "the build folder stayed")
        with tarfile.open(archive) as tar:
            members = {os.path.normpath(m.name) for m in tar.getmembers() if m.isfile()}
            for name in ("steps.tsv", "probe.log", "probe.env", "synth.log", "summary.txt",
                         "summary.json"):
                self.assertIn(name, members)
            summary = json.load(tar.extractfile("./summary.json"))
            packed_text = tar.extractfile("./summary.txt").read().decode()

        lines = done.stdout.splitlines()
        self.assertLessEqual(len(lines), 40, done.stdout)
        self.assertTrue(all(len(line) <= 120 for line in lines), done.stdout)
        self.assertIn("no step failed", lines[0])
        rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in ORDER]
        self.assertEqual([r[0] for r in rows], ORDER)
        self.assertEqual(rows[0][3], "done")
        self.assertEqual(rows[1][3], "passed")
        for row in rows[2:]:
            self.assertEqual(row[3:6], ["skipped", "dry", "run:"], row)
        # The packed summary is the one printed, up to the run's clock.
        self.assertEqual(packed_text.splitlines()[1:], lines[1:])
        self.assertEqual([s["step"] for s in summary["steps"]], ORDER)
        self.assertEqual(summary["not_passed"], [])

    @unittest.skipIf(has_gpu(), "this machine has a GPU")
    def test_without_a_gpu_one_line_and_nothing_written(self):
        out = os.path.join(self.tmp.name, "out")
        done = self.run_sh(out)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(len(done.stdout.splitlines()), 1, done.stdout)
        self.assertIn("no NVIDIA GPU", done.stdout)
        self.assertIn("nothing checked", done.stdout)
        self.assertFalse(os.path.exists(out))
        self.assertFalse(os.path.exists(self.env["DUET_BUILD_DIR"]))


class FiguresTest(unittest.TestCase):
    def test_bench_keys_are_the_ones_duet_cuda_bench_writes(self):
        # duet-cuda-bench's main file and its sections (bench/cuda/).
        paths = [os.path.join(ROOT, "bench", "cuda_bench.cpp")] + sorted(
            glob.glob(os.path.join(ROOT, "bench", "cuda", "*.cpp")))
        source = ""
        for path in paths:
            with open(path, encoding="utf-8") as f:
                source += f.read()
        for key in ("copy_gbps", "gemm_tflops", "gemv", "type", "n_x", "ratio_to_copy",
                    "model_decode", "graphs", "tokens_per_s", "model_prefill", "prompt_tokens",
                    "ratio_to_gemm", "model", "name"):
            self.assertIn(f'"{key}"', source, key)
        self.assertIn('"b1"', source)
        self.assertIn("kMaxBatch, \"b64\"", source)

    def test_figures_from_a_bench_json(self):
        bench = {
            "copy_gbps": 8000.0, "gemm_tflops": 700.0,
            "gemv": [{"type": "Q4_0", "n_x": 1, "ratio_to_copy": 0.55},
                     {"type": "Q4_0", "n_x": 8, "ratio_to_copy": 0.5}],
            "model": {"name": "synthetic llama3-8b q4_0"},
            "model_prefill": {"prompt_tokens": 2048, "tokens_per_s": 20000.0,
                              "ratio_to_gemm": 0.41},
            "model_decode": {"b1": {"graphs": {"tokens_per_s": 250.0, "ratio_to_copy": 0.72}},
                             "b64": {"graphs": {"tokens_per_s": 9000.0, "ratio_to_copy": 0.40}}},
        }
        figures = run_summary.bench_figures(bench)
        self.assertEqual(figures["decode_b1_of_copy"], 0.72)
        self.assertEqual(figures["decode_b64_tokens_per_s"], 9000.0)
        self.assertEqual(figures["prefill_of_gemm"], 0.41)
        self.assertEqual(figures["gemv_q4_0_b1_of_copy"], 0.55)
        text = "\n".join(run_summary.figure_lines({}, figures, (700.0, 1000.0, 8.0)))
        self.assertIn("decode batch 1: 250 tokens/s, 0.72 of copy  [goal >= 0.70: met]", text)
        self.assertIn("prefill of 2048 tokens: 20,000 tokens/s, 0.41 of GEMM  [goal >= 0.50: "
                      "not met]", text)
        self.assertIn("0.70 of a device copy of the same size", text)

    def test_ipc_line_as_ipc_kv_check_prints_it(self):
        with open(os.path.join(HERE, "ipc_kv_check.cpp"), encoding="utf-8") as f:
            source = f.read()
        match = re.search(r'"([^"]*same %d payloads[^"]*)"\s*"([^"]*)"', source)
        self.assertIsNotNone(match, "the IPC rate's printf in ipc_kv_check.cpp")
        line = (match.group(1) + match.group(2)).replace("\\n", "\n") % (48, 8.0, 1234.5, 1000.0,
                                                                       0.81)
        with tempfile.TemporaryDirectory() as work:
            with open(os.path.join(work, "ipc_kv.log"), "w", encoding="utf-8") as f:
                f.write("[ case ] IPC transfer rate\n" + line)
            self.assertEqual(run_summary.ipc_figures(work, "ipc_kv.log"), (1000.0, 1234.5, 8.0))


if __name__ == "__main__":
    unittest.main(verbosity=2)
