"""`duet serve` with tensor-parallel instances under mpirun, against the
single-process `duet serve`. One layout per run, named by DUET_TP_LAYOUT:

  colocated  one instance of TP=2 (ranks 1-2), both phases;
  1to3       a prefill instance of TP=1 (rank 1), a decode instance of TP=3
             (ranks 2-4): every decode rank receives its KV head's rows
             straight from the prefill rank;
  3to1       a prefill instance of TP=3 (ranks 1-3), a decode instance of TP=1
             (rank 4): the decode rank receives one KV head from each.

Checks:
- greedy and seeded-sampling completions equal the single process's, token
  for token: no logit is ever a sum over ranks (O and down gather their
  whole inputs and split their output rows), so TP changes no bit of the logits
  (mpi_tp_forward_test checks the logits themselves);
- seeded sampling and a 24-request burst give what the same requests give
  one at a time (every rank runs the same batch: batching does not change a
  token under TP either);
- cancels while the prompt is computed, shipped and decoded free every block;
- every rank of the instances takes part (followers log their shard; in the
  disaggregated layouts every prefill rank sends KV and every decode rank
  receives some, with checksums on and no failed import);
- SIGTERM to the coordinator ends every rank with exit 0.

Run by ctest (tests/mpi/tp_tests.cmake) with DUET_BINARY, DUET_MODEL,
DUET_MPIEXEC and DUET_TP_LAYOUT set (and DUET_KV_TRANSPORT: mpi by default, or
tcp).
"""

import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mpirun_serve  # noqa: E402
from mpirun_serve import (ServeProcess, cancel_after, complete, complete_all,  # noqa: E402
                          expect_serving, greedy_and_seeded, open_stream, read_events,
                          start_cluster, stop_cluster, stop_every_rank, wait_until, words)

ENGINE = ["--kv-cache-mem", "128MiB", "--step-tokens", "128"]
LAYOUTS = {
    # No instance count: -np 3 with --tp 2 makes one instance (common/cluster/cluster_spec.h).
    "colocated": (3, ["--mode", "colocated", "--tp", "2"]),
    "1to3": (5, ["--prefill", "1", "--decode", "1", "--decode-tp", "3", "--kv-checksums"]),
    "3to1": (5, ["--prefill", "1", "--decode", "1", "--prefill-tp", "3", "--kv-checksums"]),
}
LAYOUT = os.environ.get("DUET_TP_LAYOUT", "colocated")
RANKS, FLAGS = LAYOUTS[LAYOUT]
# How the disaggregated layouts move KV (--kv-transport): mpi unless told.
FLAGS = [*FLAGS, "--kv-transport", os.environ.get("DUET_KV_TRANSPORT", "mpi")]
cluster = None


def setUpModule():
    global cluster
    cluster = start_cluster(RANKS, [*FLAGS, *ENGINE])


def tearDownModule():
    stop_cluster(cluster)


def every_block_free():
    return mpirun_serve.every_block_free(cluster)


def text_of(server, body):
    return complete(server, body)["choices"][0]["text"]


def first_difference(a, b):
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class TensorParallelClusterTest(unittest.TestCase):
    def test_1_outputs_equal_the_single_process(self):
        prompts = ["The capital of France is", "def fibonacci(n):",
                   "Write a haiku about the sea.", "Once upon a time, in a small village,",
                   "Summarize: " + words(300, 1),  # several 128-token chunks
                   "List the words: " + words(700, 2), "The three primary colors are",
                   "Question: what is 12 times 12? Answer:"]
        bodies = greedy_and_seeded(prompts, max_tokens=24)
        with ServeProcess(ENGINE) as single:
            expected = [text_of(single, b) for b in bodies]
        for body, want in zip(bodies, expected):
            got = text_of(cluster, body)
            at = first_difference(got, want)
            self.assertEqual(got, want, f"{LAYOUT}: {body['prompt'][:30]!r}, temperature "
                                        f"{body['temperature']}: differs from character {at}")
        wait_until(every_block_free, 20, "every KV block free")

    def test_2_batching_does_not_change_a_token(self):
        n = 24
        bodies = []
        for i in range(n):
            body = {"prompt": f"Story {i}: " + words(10 + 37 * (i % 5), i),
                    "max_tokens": 8 + 4 * (i % 3), "ignore_eos": True}
            body.update({"temperature": 0} if i % 2 == 0 else
                        {"temperature": 0.9, "seed": 1000 + i, "top_p": 0.95})
            bodies.append(body)
        alone = [text_of(cluster, b) for b in bodies[:6]]
        results = complete_all(cluster, bodies)
        for i, r in enumerate(results):
            self.assertIsInstance(r, dict, f"request {i}: {r}")
        self.assertEqual([r["choices"][0]["text"] for r in results[:6]], alone)
        wait_until(every_block_free, 30, "every KV block free after the burst")

    def test_3_cancels_in_every_phase_free_every_block(self):
        body = {"prompt": "Translate: " + words(1200, 3), "max_tokens": 400, "ignore_eos": True,
                "stream": True, "temperature": 0}
        cancel_after(cluster, body, (0.05, 0.3, 0.8))  # while the prompt is computed and shipped
        sock = open_stream(cluster, body)  # during decode, after a few tokens
        read_events(sock, 3)
        sock.close()
        wait_until(every_block_free, 90, "every KV block free after the cancels")
        expect_serving(cluster, "After the cancels:")

    def test_4_every_rank_takes_part_and_exits_0(self):
        log = stop_every_rank(cluster, timeout=60)
        followers = re.findall(r"tensor-parallel follower (\d) of (\d)", log)
        self.assertEqual(len(followers), 1 if LAYOUT == "colocated" else 2, log)
        shares = [float(s) for s in re.findall(r"weight bytes of its own \(([\d.]+)% of", log)]
        print(f"  {LAYOUT}: owned weight bytes per shard, % of the split tensors: {shares}",
              file=sys.stderr)
        self.assertTrue(shares, log)
        if LAYOUT == "colocated":
            return
        # Bytes as messages plus rows read by cross-memory attach (MPI on one host).
        sent, received = {}, {}
        for r, s, got, cma_s, cma_got in re.findall(
                r"rank (\d)\): kv transfer: \d+ messages \((\d+) bytes\) sent, \d+ \((\d+) "
                r"bytes\) received, .* rows by cross-memory attach: (\d+) bytes sent, (\d+) "
                r"received", log):
            sent[int(r)] = int(s) + int(cma_s)
            received[int(r)] = int(got) + int(cma_got)
        prefill, decode = ([1], [2, 3, 4]) if LAYOUT == "1to3" else ([1, 2, 3], [4])
        for rank in prefill:  # sends rows (the leader also its handoffs)
            self.assertGreater(sent.get(rank, 0), 1_000_000, (rank, sent))
        for rank in decode:  # receives its KV heads' rows itself
            self.assertGreater(received.get(rank, 0), 1_000_000, (rank, received))
        failed = [int(n) for n in re.findall(r"imports completed, (\d+) failed", log)]
        self.assertEqual(len(failed), RANKS - 1, log)
        self.assertEqual(sum(failed), 0, log)  # every checksum matched, no deadline passed
        # A cancel found its KV in transfer: the followers let go of their imports too.
        self.assertIn("cancelled before its KV arrived", log)


if __name__ == "__main__":
    unittest.main(verbosity=2)
