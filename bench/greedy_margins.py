#!/usr/bin/env python3
"""Greedy tokens of one GGUF in Duet and in llama.cpp, and how far apart their top two stand.

Two engines that round differently still pick the same greedy token where
the top two log-probabilities stand further apart than the engines'
rounding differences; where they do not, the tie is broken by rounding and
the texts part for no fault of either. For each prompt this runs:

  llama.cpp   `llama-server` (bench/build_llama_cpp.sh, its defaults, one
              slot), /completion with temperature 0 and n_probs 2: its greedy
              path and, at each step, its top two log-probabilities;
  Duet        `duet generate --temp 0 --token-ids`, the single-prompt path:
              its greedy path; and `duet-logits` on the prompt followed by
              llama.cpp's path, teacher-forced, each generated token computed
              as Duet's generation computes it: Duet's top two at the same
              positions.

and prints, per prompt and over all, how many generated tokens agree (up to
the first parting), how many distinct tokens llama.cpp's paths hold, the
smallest llama.cpp margin (log-probability of its first token minus its
second's, the same as their logits' difference) and Duet's margin at that
step, the median margin, and the median and largest difference between the
engines' margins over the steps (the rounding difference a margin must
stand above). With --json, every step too.

    bench/greedy_margins.py MODEL [-n 32] [--threads 2] [--prompt TEXT ...] [--llama-args '-fa off']

DUET_BUILD_DIR (default build) holds `duet` and `duet-logits`.
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "In 1905, Einstein", "SELECT * FROM", "The quick brown fox", "Dear Sir or Madam,",
           "import numpy as np"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port, path, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


class LlamaServer:
    def __init__(self, model, threads, log, extra=()):
        binary = subprocess.run([os.path.join(ROOT, "bench/build_llama_cpp.sh")],
                                env=dict(os.environ, TARGETS="llama-server"), check=True,
                                stdout=subprocess.PIPE, stderr=log, text=True).stdout.split()[-1]
        self.port = free_port()
        self.process = subprocess.Popen(
            [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
             "-t", str(threads), "-c", "4096", *extra], stdout=log, stderr=log)
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy in 600 s")
            time.sleep(0.5)

    def greedy(self, prompt, n):
        """(prompt ids, [(token, [(id, logprob) of the top two])] per step)."""
        ids = post(self.port, "/tokenize", {"content": prompt, "add_special": True})["tokens"]
        reply = post(self.port, "/completion", {
            "prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 2, "cache_prompt": False,
            "ignore_eos": True})
        steps = [(p["id"], [(t["id"], t["logprob"]) for t in p["top_logprobs"]])
                 for p in reply["completion_probabilities"]]
        return ids, steps

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def duet_greedy(build, model, prompt, n, threads):
    out = subprocess.run([os.path.join(build, "tools/duet"), "generate", "-m", model, "-p", prompt,
                          "-n", str(n), "--temp", "0", "--ignore-eos", "--token-ids", "-t",
                          str(threads)], check=True, capture_output=True, text=True).stderr
    line = next(l for l in out.splitlines() if l.startswith("token_ids: "))
    return json.loads(line[len("token_ids: "):])


def duet_top2(build, model, ids, n_prompt, threads):
    out = subprocess.run([os.path.join(build, "bench/duet-logits"), "-m", model, "--ids",
                          json.dumps(ids), "--prompt", str(n_prompt), "--from", str(n_prompt - 1),
                          "--top", "2", "-t", str(threads)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["rows"]


def margin(top):
    return top[0][1] - top[1][1]


def row(name, alike, tokens, llama_margins, duet_margins, one_prompt=True):
    """A table row: agreement up to the first parting, and margins against differences
    (the smallest margin's step is named for one prompt's row)."""
    differences = sorted(abs(a - b) for a, b in zip(llama_margins, duet_margins))
    low = min(range(len(llama_margins)), key=lambda i: llama_margins[i])
    step = f" ({low})" if one_prompt else ""
    return (f"| {name} | {alike} of {len(llama_margins)} | {len(tokens)} "
            f"| {llama_margins[low]:.4f}{step} "
            f"| {duet_margins[low]:.4f} | {statistics.median(llama_margins):.4f} "
            f"| {statistics.median(differences):.1e} / {differences[-1]:.1e} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=32, help="tokens generated per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable; default: eight)")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server arguments, e.g. '-fa off' (default: its defaults)")
    ap.add_argument("--json", action="store_true", help="print every step as JSON too")
    args = ap.parse_args()
    build = os.environ.get("DUET_BUILD_DIR", os.path.join(ROOT, "build"))
    prompts = args.prompt or PROMPTS
    with tempfile.TemporaryFile(mode="w+") as log:
        server = LlamaServer(args.model, args.threads, log, args.llama_args.split())
        try:
            llama = [server.greedy(p, args.n) for p in prompts]
        except Exception:
            log.seek(0)
            sys.stderr.write(log.read()[-4000:])
            raise
        finally:
            server.close()
    print(f"model: {os.path.basename(args.model)}; {args.n} greedy tokens per prompt; "
          f"llama-server {args.llama_args or '(defaults)'}")
    print("| prompt | tokens alike | distinct | smallest llama.cpp margin (step) | Duet's there "
          "| median margin | median / largest margin difference |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    report = []
    totals = {"alike": 0, "tokens": set(), "llama": [], "duet": []}
    for prompt, (ids, steps) in zip(prompts, llama):
        path = [token for token, _ in steps]
        duet_path = duet_greedy(build, args.model, prompt, args.n, args.threads)
        alike = next((i for i, (a, b) in enumerate(zip(path, duet_path)) if a != b), len(path))
        duet_rows = duet_top2(build, args.model, ids + path[:-1], len(ids), args.threads)
        llama_margins = [margin(top) for _, top in steps]
        duet_margins = [margin(top) for top in duet_rows]
        print(row(repr(prompt), alike, set(path), llama_margins, duet_margins))
        totals["alike"] += alike
        totals["tokens"] |= set(path)
        totals["llama"] += llama_margins
        totals["duet"] += duet_margins
        report.append({"prompt": prompt, "prompt_ids": ids, "llama_path": path,
                       "duet_path": duet_path, "llama_margins": llama_margins,
                       "duet_margins": duet_margins})
    print(row("**all**", totals["alike"], totals["tokens"], totals["llama"], totals["duet"],
              one_prompt=False))
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
