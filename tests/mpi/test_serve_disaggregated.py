"""`duet serve` disaggregated under mpirun: a coordinator (rank 0), one
prefill instance (rank 1) and two decode instances (ranks 2 and 3), KV
shipped with checksums on unless told otherwise, against the
single-process `duet serve`. The KV transport is DUET_KV_TRANSPORT's
(`--kv-transport`: mpi by default, tcp for TcpKvTransfer over loopback), the
control channel's link DUET_CONTROL_TRANSPORT's (`--control-transport`: auto
by default, which is mpi on one host; tcp for the coordinator's messages
over Duet's own sockets on loopback); DUET_KV_CMA says whether KV over MPI may go by cross-memory attach
(`--kv-cma`: auto by default, which it then must; off for every payload as an
MPI message), and DUET_KV_CHECKSUMS=off drops `--kv-checksums` (checksummed
rows are always packed; without them TcpKvTransfer sends from the blocks).

- greedy and seeded-sampling completions are identical to the single
  process's, for prompts of one chunk and of many (the step budget is small);
- 64 concurrent requests of mixed lengths all complete, over both decode
  instances;
- cancels (client disconnects) during prefill, during the KV transfer and
  during decode leave every block free on every rank;
- a prompt that no decode instance can hold is a clear 400, and the cluster
  goes on serving;
- SIGTERM to the coordinator ends every rank with exit 0; every transfer's
  checksum matched, when on (no import failed).

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import random
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpirun_serve  # noqa: E402
from mpirun_serve import (ServeProcess, cancel_after, complete, complete_all,  # noqa: E402
                          expect_serving, greedy_and_seeded, http_request, open_stream,
                          read_events, requests_routed, start_cluster, stop_cluster,
                          stop_every_rank, wait_until, words)

# 128 MiB of KV per instance: 5825 tokens of the default model, under its
# 8192-token context, so a request can be too big for the KV cache alone.
ENGINE = ["--kv-cache-mem", "128MiB", "--step-tokens", "128"]
KV_TRANSPORT = os.environ.get("DUET_KV_TRANSPORT", "mpi")
CONTROL_TRANSPORT = os.environ.get("DUET_CONTROL_TRANSPORT", "auto")
KV_CMA = os.environ.get("DUET_KV_CMA", "auto")
# Checksummed rows are always packed; without them TcpKvTransfer sends from the blocks.
CHECKSUMS = ["--kv-checksums"] if os.environ.get("DUET_KV_CHECKSUMS", "on") == "on" else []
CLUSTER = ["--prefill", "1", "--decode", "2", *CHECKSUMS, "--kv-transport", KV_TRANSPORT,
           "--kv-cma", KV_CMA, "--control-transport", CONTROL_TRANSPORT, *ENGINE]
cluster = None


def setUpModule():
    global cluster
    cluster = start_cluster(4, CLUSTER)


def tearDownModule():
    stop_cluster(cluster)


def every_block_free():
    return mpirun_serve.every_block_free(cluster)


class DisaggregatedClusterTest(unittest.TestCase):
    def test_1_outputs_equal_the_single_process(self):
        prompts = ["The capital of France is", "def fibonacci(n):",
                   "Summarize: " + words(300, 1),  # several 128-token chunks
                   "List the words: " + words(700, 2)]
        bodies = greedy_and_seeded(prompts, max_tokens=20)
        with ServeProcess(ENGINE) as single:
            expected = [complete(single, b)["choices"][0]["text"] for b in bodies]
        for body, text in zip(bodies, expected):
            got = complete(cluster, body)["choices"][0]["text"]
            self.assertEqual(got, text, f"prompt {body['prompt'][:40]!r}, "
                                        f"temperature {body['temperature']}")
        # The chat endpoint goes the same way (template applied on the coordinator).
        status, _, reply = http_request(
            cluster.http_url + "/v1/chat/completions", "POST",
            {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
             "temperature": 0})
        self.assertEqual(status, 200, reply[:300])
        wait_until(every_block_free, 20, "every KV block free")

    def test_2_sixty_four_concurrent_mixed_requests_complete(self):
        n = 64
        rng = random.Random(64)
        bodies = [{"prompt": f"Request {i}: " + words(rng.choice([4, 20, 60, 150, 400]), i),
                   "max_tokens": rng.choice([4, 12, 32]), "temperature": 0, "ignore_eos": True}
                  for i in range(n)]
        results = complete_all(cluster, bodies)
        for i, r in enumerate(results):
            self.assertIsInstance(r, dict, f"request {i}: {r}")
            self.assertEqual(r["usage"]["completion_tokens"], bodies[i]["max_tokens"])
        wait_until(every_block_free, 20, "every KV block free after the burst")

    def test_3_cancels_in_every_phase_free_every_block(self):
        long_prompt = "Translate: " + words(1500, 3)  # 12+ prefill chunks
        body = {"prompt": long_prompt, "max_tokens": 500, "ignore_eos": True, "stream": True,
                "temperature": 0}
        # Before the first token: while the prompt is prefilled and shipped.
        cancel_after(cluster, body, (0.02, 0.1, 0.25, 0.5, 0.8))
        # During decode: after a few streamed tokens.
        socks = [open_stream(cluster, body) for _ in range(2)]
        for sock in socks:
            read_events(sock, 3)
        for sock in socks:
            sock.close()
        wait_until(every_block_free, 60, "every KV block free after the cancels")
        expect_serving(cluster, "After the cancels:")

    def test_4_a_prompt_no_decode_instance_can_hold_is_a_clear_error(self):
        # Within the model's context (8192), over every instance's KV cache (5825 tokens).
        for body in ({"prompt": "A short prompt", "max_tokens": 7000},
                     {"prompt": words(5000, 4), "max_tokens": 1000}):
            reply = complete(cluster, body, expect=400)
            message = reply["error"]["message"]
            self.assertRegex(message, r"limit of 58\d\d|over the 58\d\d tokens a sequence can hold")
            print(f"  refused: {message}", file=sys.stderr)
        expect_serving(cluster, "Still serving:")

    def test_5_sigterm_ends_every_rank_with_exit_0(self):
        log = stop_every_rank(cluster, timeout=30)
        routed = requests_routed(log)
        self.assertEqual(sorted(routed), [0, 1, 2], log)
        self.assertGreaterEqual(min(routed[1], routed[2]), 10, routed)  # both decode instances
        self.assertEqual(routed[0], routed[1] + routed[2])  # every prompt went through prefill
        failed = [int(n) for n in re.findall(r"imports completed, (\d+) failed", log)]
        self.assertEqual(len(failed), 3, log)
        self.assertEqual(sum(failed), 0, log)  # every checksum matched, no deadline passed
        # At least one cancel found its KV still in transfer.
        self.assertIn("cancelled before its KV arrived", log)
        # The KV went the way asked, and bytes moved on every instance.
        self.assertIn(f"kv transfer: between instances over {KV_TRANSPORT}", log)
        control = "mpi" if CONTROL_TRANSPORT == "auto" else CONTROL_TRANSPORT  # one host
        self.assertIn(f"control channel: coordinator to ranks over {control}", log)
        sent = [int(n) for n in re.findall(r"kv transfer: \d+ messages \((\d+) bytes\) sent", log)]
        self.assertEqual(len(sent), 3, log)
        self.assertTrue(all(n > 0 for n in sent), sent)
        # Over MPI on one host the rows went by cross-memory attach, unless told not to.
        cma = [(int(s), int(r)) for s, r in re.findall(
            r"rows by cross-memory attach: (\d+) bytes sent, (\d+) received", log)]
        self.assertEqual(len(cma), 3, log)
        if KV_TRANSPORT == "mpi" and KV_CMA == "auto":
            self.assertGreater(sum(s for s, _ in cma), 0, cma)  # by the prefill instance
            self.assertEqual(sum(1 for _, r in cma if r > 0), 2, cma)  # into both decode instances
        else:
            self.assertEqual(cma, [(0, 0)] * 3, cma)


if __name__ == "__main__":
    unittest.main(verbosity=2)
