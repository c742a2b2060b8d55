"""duet-bench end to end: the real `duet serve` driven over Cap'n Proto and
over HTTP, open and closed loop, a trace made by `duet-bench make-trace`.

Checks that every request succeeds and receives exactly the requested number
of tokens, and that each request's client-side TTFT and E2E agree with the
server's own timings (the client's are never shorter, and longer only by
transfer and scheduling: by at most 50 ms + 20% at the median; a request
whose client the kernel kept waiting on a busy machine may take up to 500 ms
more). Refused requests stay in the statistics, counted by kind.

Run by ctest (tests/bench/duet_bench_tests.cmake) with DUET_BINARY, DUET_BENCH
and DUET_MODEL set.
"""

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "serve"))
from serve_process import ServeProcess  # noqa: E402

EPSILON_S = 0.002  # clock granularity and rounding between the two processes
SLACK_S = 0.050  # the median request's
SLACK_MAX_S = 0.500  # any request's
SLACK_FRACTION = 0.20
INPUT_LEN = 32
OUTPUT_LEN = 8


class DuetBenchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.bench = os.environ.get("DUET_BENCH")
        if not cls.bench or not os.path.exists(cls.bench):
            raise RuntimeError(f"DUET_BENCH must name the duet-bench binary (got {cls.bench!r})")
        cls.server = ServeProcess()
        cls.server.start()
        cls.tmp = tempfile.TemporaryDirectory()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def run_bench(self, args, name, http=False):
        """Runs duet-bench with `args` against the server; returns its JSON report."""
        target = (["--http", self.server.http_url] if http else
                  ["--connect", f"{self.server.rpc_host}:{self.server.rpc_port}"])
        out = self.path(name + ".json")
        command = [self.bench, *target, *args, "--seed", "7", "--json", out, "--no-progress"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0,
                         f"{' '.join(command)}\n{result.stdout}\n{result.stderr}")
        self.assertIn("TTFT", result.stdout)  # the human table
        with open(out) as f:
            return json.load(f)

    def check_requests(self, run, n, output_len=None, server_timings=True):
        summary, requests = run["summary"], run["requests"]
        self.assertEqual(summary["n_requests"], n)
        self.assertEqual(summary["n_ok"], n, summary["errors"])
        self.assertEqual(len(requests), n)
        self.assertEqual([r["index"] for r in requests], list(range(n)))
        excess = {"ttft": [], "e2e": []}  # the client's time past the server's
        for r in requests:
            with self.subTest(index=r["index"]):
                self.assertTrue(r["ok"], r["error_message"])
                expected = output_len if output_len is not None else r["output_tokens"]
                self.assertEqual(r["received_tokens"], expected)
                self.assertGreaterEqual(r["sent_s"], r["scheduled_s"] - 1e-6)
                self.assertIsNotNone(r["first_token_s"])
                self.assertTrue(1 <= len(r["token_times_s"]) <= expected)
                self.assertEqual(r["token_times_s"], sorted(r["token_times_s"]))
                self.assertLessEqual(r["token_times_s"][-1], r["finished_s"])
                if not server_timings:
                    continue
                client_ttft = r["first_token_s"] - r["sent_s"]
                client_e2e = r["finished_s"] - r["sent_s"]
                for name, client, server in (("ttft", client_ttft, r["server_ttft_s"]),
                                             ("e2e", client_e2e, r["server_e2e_s"])):
                    self.assertIsNotNone(server, name)
                    self.assertGreaterEqual(client, server - EPSILON_S, name)
                    self.assertLessEqual(client, server + SLACK_MAX_S + SLACK_FRACTION * server,
                                         name)
                    excess[name].append(client - server - SLACK_FRACTION * server)
        for name, values in excess.items():
            if values:
                self.assertLessEqual(statistics.median(values), SLACK_S, (name, sorted(values)))
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            self.assertGreater(summary[key]["p50"], 0, key)
            self.assertLessEqual(summary[key]["p50"], summary[key]["p99"], key)
        self.assertGreater(summary["request_rate"], 0)
        self.assertGreater(summary["output_token_rate"], 0)

    def open_loop(self, http):
        report = self.run_bench(["--rate", "4", "-n", "12", "--input-len", str(INPUT_LEN),
                                 "--output-len", str(OUTPUT_LEN), "--slo", "ttft=5000,tpot=1000"],
                                "http" if http else "rpc", http=http)
        self.assertEqual(report["config"]["protocol"], "http" if http else "rpc")
        self.assertEqual(report["slo"], {"ttft_ms": 5000, "tpot_ms": 1000})
        run, = report["runs"]
        self.assertEqual(run["rate"], 4)
        self.check_requests(run, 12, OUTPUT_LEN)
        self.assertTrue(all(r["prompt_tokens"] == INPUT_LEN for r in run["requests"]))
        # Open loop: each request left at its planned time, whatever was in flight.
        for r in run["requests"]:
            self.assertLess(r["sent_s"] - r["scheduled_s"], 0.05)
        self.assertAlmostEqual(run["summary"]["goodput_fraction"], 1.0)

    def test_open_loop_rpc(self):
        self.open_loop(http=False)

    def test_open_loop_http(self):
        self.open_loop(http=True)

    def test_closed_loop(self):
        report = self.run_bench(["--concurrency", "3", "-n", "9", "--input-len", "uniform:16:48",
                                 "--output-len", str(OUTPUT_LEN)], "closed")
        run, = report["runs"]
        self.assertEqual(run["concurrency"], 3)
        self.check_requests(run, 9, OUTPUT_LEN)
        # Never more than 3 in flight: when the k-th (0-based) request leaves,
        # at least k - 2 have finished.
        requests = run["requests"]
        ends = [r["finished_s"] for r in requests]
        for k, r in enumerate(sorted(requests, key=lambda r: r["sent_s"])):
            self.assertGreaterEqual(len([e for e in ends if e <= r["sent_s"] + 1e-6]), k - 2)

    def test_no_stream_http(self):
        report = self.run_bench(["--rate", "8", "-n", "4", "--input-len", str(INPUT_LEN),
                                 "--output-len", str(OUTPUT_LEN), "--no-stream"], "nostream",
                                http=True)
        run, = report["runs"]
        self.assertEqual(run["summary"]["n_ok"], 4)
        for r in run["requests"]:
            self.assertEqual(r["received_tokens"], OUTPUT_LEN)
            self.assertIsNone(r["first_token_s"])
            self.assertGreaterEqual(r["finished_s"] - r["sent_s"], r["server_e2e_s"] - EPSILON_S)
        self.assertGreater(run["summary"]["e2e_ms"]["p50"], 0)

    def test_make_trace_and_replay(self):
        trace = self.path("trace.csv")
        result = subprocess.run([self.bench, "make-trace", "--mix", "chat", "-n", "20",
                                 "--rate", "8", "--seed", "3", "-o", trace],
                                capture_output=True, text=True, timeout=30)
        self.assertEqual(result.returncode, 0, result.stderr)
        with open(trace) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 20)
        self.assertTrue({"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= rows[0].keys())
        # The first 4 rows, replayed 2x faster; long outputs: timings only loosely checked.
        report = self.run_bench(["--trace", trace, "-n", "4", "--time-scale", "2"], "trace")
        run, = report["runs"]
        self.check_requests(run, 4, server_timings=False)
        for r, row in zip(run["requests"], rows):
            self.assertEqual(r["prompt_tokens"], int(row["ContextTokens"]))
            self.assertEqual(r["received_tokens"], int(row["GeneratedTokens"]))
            self.assertAlmostEqual(r["scheduled_s"], float(row["TIMESTAMP"]) / 2, places=3)

    def test_refusals_are_counted(self):
        for http in (False, True):
            with self.subTest(http=http):
                report = self.run_bench(["--rate", "inf", "-n", "3", "--input-len", "100000",
                                         "--output-len", "4"], f"refused-{http}", http=http)
                summary = report["runs"][0]["summary"]
                self.assertEqual(summary["n_requests"], 3)
                self.assertEqual(summary["n_ok"], 0)
                self.assertEqual(sum(summary["errors"].values()), 3)
                kind, = summary["errors"]
                self.assertEqual(kind, "http_400" if http else "too_long")
                self.assertTrue(all(r["error_message"] for r in report["runs"][0]["requests"]))

    def test_plot(self):
        png = self.path("plot.png")
        target = ["--connect", f"{self.server.rpc_host}:{self.server.rpc_port}"]
        result = subprocess.run([self.bench, *target, "--rate", "8,inf", "-n", "3", "--input-len",
                                 "8", "--output-len", "2", "--plot", png, "--no-progress"],
                                capture_output=True, text=True, timeout=120)
        self.assertEqual(result.returncode, 0, result.stderr)
        # Either the figure, or the message that says what to install.
        self.assertTrue(os.path.exists(png) or "pip install matplotlib" in result.stderr,
                        result.stderr)

    def test_unreachable_server(self):
        result = subprocess.run([self.bench, "--connect", "127.0.0.1:1", "--rate", "1", "-n", "1"],
                                capture_output=True, text=True, timeout=30)
        self.assertEqual(result.returncode, 1)
        self.assertIn("cannot connect", result.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
