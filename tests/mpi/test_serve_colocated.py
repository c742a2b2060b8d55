"""`duet serve` as a colocated cluster under mpirun: a coordinator (rank 0) and
two instances (ranks 1 and 2), against the single-process `duet serve`.

- greedy completions over HTTP are identical to the single process's (text,
  and the token ids of prompt and completion through /tokenize);
- 16+ concurrent requests all complete and spread over both instances;
- a client that disconnects mid-stream frees every KV block on every rank;
- SIGTERM to the coordinator ends every rank with exit 0 within seconds;
- a spec that does not match -np, ranks that make no whole instance, and a tp
  over the model's KV heads, fail fast with the same error
  on every rank.

The disaggregated cluster has its own test (test_serve_disaggregated.py).

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import json
import os
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (ServeProcess, complete, http_request, metrics, open_stream,  # noqa: E402
                          read_events, requests_routed, run, serve_environment, start_cluster,
                          stop_cluster, stop_every_rank, wait_until)

CLUSTER = ["--mode", "colocated", "--prefill", "1", "--decode", "1", "--kv-cache-mem", "256MiB"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a quiet village,",
           "1, 2, 3, 4,", "The three primary colors are"]
cluster = None


def setUpModule():
    global cluster
    cluster = start_cluster(3, CLUSTER)


def tearDownModule():
    stop_cluster(cluster)


def tokenize(server, text):
    status, _, reply = http_request(server.http_url + "/tokenize", "POST",
                                    {"content": text, "add_special": False})
    assert status == 200, (status, reply[:500])
    return json.loads(reply)["tokens"]


class ColocatedClusterTest(unittest.TestCase):
    def test_1_greedy_output_equals_the_single_process(self):
        bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
                  for p in PROMPTS]
        with ServeProcess(["--kv-cache-mem", "256MiB"]) as single:
            expected = [complete(single, b)["choices"][0]["text"] for b in bodies]
            expected_ids = [tokenize(single, p + t) for p, t in zip(PROMPTS, expected)]
            ids_prompt = {"prompt": tokenize(single, PROMPTS[0]), "max_tokens": 16,
                          "temperature": 0}
            expected_from_ids = complete(single, ids_prompt)["choices"][0]["text"]
        for body, text, ids, prompt in zip(bodies, expected, expected_ids, PROMPTS):
            got = complete(cluster, body)["choices"][0]["text"]
            self.assertEqual(got, text, f"prompt {prompt!r}")
            self.assertEqual(tokenize(cluster, prompt + got), ids, f"prompt {prompt!r}")
        self.assertEqual(complete(cluster, ids_prompt)["choices"][0]["text"], expected_from_ids)

    def test_2_concurrent_requests_spread_over_both_instances(self):
        n = 16
        results = [None] * n

        def one(i):
            results[i] = complete(cluster, {"prompt": f"Request {i}: tell me about number {i}.",
                                            "max_tokens": 12, "temperature": 0,
                                            "ignore_eos": True})

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        for i, r in enumerate(results):
            self.assertIsNotNone(r, f"request {i} did not complete")
            self.assertEqual(r["usage"]["completion_tokens"], 12)
        m = metrics(cluster)
        self.assertEqual(m["duet_running_sequences"], 0)
        # Each instance's engine counts its own steps; the router's placement
        # is checked at shutdown (test_4), where the coordinator logs it.

    def test_3_client_disconnect_frees_every_block_on_every_rank(self):
        body = {"prompt": "Write a long story.", "max_tokens": 2000, "ignore_eos": True,
                "stream": True, "temperature": 0}
        socks = [open_stream(cluster, body, timeout=30) for _ in range(4)]  # on both instances
        for sock in socks:
            read_events(sock, 3)
        wait_until(lambda: metrics(cluster)["duet_running_sequences"] == 4, 30, "4 running")
        m = metrics(cluster)
        self.assertLess(m["duet_kv_blocks_free"], m["duet_kv_blocks_total"])
        for sock in socks:
            sock.close()

        def freed():
            m = metrics(cluster)
            return (m["duet_running_sequences"] == 0 and
                    m["duet_kv_blocks_free"] == m["duet_kv_blocks_total"])

        wait_until(freed, 20, "every KV block free after the disconnects")

    def test_4_sigterm_ends_every_rank_with_exit_0(self):
        pids = cluster.rank_pids()
        self.assertEqual(sorted(pids), [0, 1, 2])
        start = time.monotonic()
        log = stop_every_rank(cluster, timeout=30)
        self.assertLess(time.monotonic() - start, 10, log)
        # Where the coordinator sent the requests: both instances got some.
        routed = requests_routed(log)
        self.assertEqual(sorted(routed), [0, 1], log)
        self.assertGreaterEqual(min(routed.values()), 4, routed)


class ClusterSpecErrorTest(unittest.TestCase):
    def expect_same_error(self, ranks, args, message):
        binary, model = serve_environment()
        mpirun = os.environ.get("DUET_MPIEXEC", "mpirun")
        start = time.monotonic()
        code, output = run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
                            binary, "serve", "--model", model, "--threads", "1",
                            "--rpc-port", "0", "--http-port", "0", *args], timeout=60)
        self.assertNotEqual(code, 0, output)
        self.assertLess(time.monotonic() - start, 30, output)
        lines = [line for line in output.splitlines() if message in line]
        self.assertEqual(len(lines), ranks, output)
        self.assertEqual(len(set(lines)), 1, output)

    def test_spec_that_does_not_match_np(self):
        self.expect_same_error(3, ["--mode", "colocated", "--prefill", "1", "--decode", "2"],
                               "cluster spec: the spec needs 4 processes (1 coordinator + 3 "
                               "instance ranks) but mpirun started 3 (mpirun -np 4)")

    def test_ranks_that_make_no_whole_instance_name_what_would(self):
        self.expect_same_error(3, ["--mode", "colocated", "--tp", "3"],
                               "cluster spec: -np 3 leaves 2 instance rank(s), not a whole number "
                               "of colocated instances of tp 3: run -np 4 or give --decode D")

    def test_more_tp_ranks_than_kv_heads_is_refused(self):
        # The default model has 3 KV heads; attention is split by KV heads.
        self.expect_same_error(5, ["--mode", "colocated", "--decode", "1", "--tp", "4"],
                               "instance 0 has tp 4, more than the model's 3 KV heads")


if __name__ == "__main__":
    unittest.main(verbosity=2)
