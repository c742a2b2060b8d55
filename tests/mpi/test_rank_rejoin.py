"""A rank of the mpirun job lost by silence that wakes rejoins.

A colocated cluster of two one-rank instances under mpirun --enable-recovery
opens a known --join-port with a cluster key. Rank 2 is SIGSTOPped past its
lease (1 s) while streams run: the coordinator counts it lost and re-runs
what it held. Woken, it learns it was lost, drops its engine and its KV,
and joins through the join port as a new member (a new instance id, under
the epoch its loss made), where a rank without a join port leaves. It is
routed to again: two instances up, every text the single-process
`duet generate`'s, before and after. SIGTERM to the coordinator then ends
the cluster, the rejoined rank included, every rank with exit code 0.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import signal
import socket
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (MpirunServe, check_texts, metrics, start_sse,  # noqa: E402
                          stop_every_rank, wait_until, write_key)
from test_failover import generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def greedy(prompt):
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def instances_up(server):
    return sum(v for k, v in metrics(server).items() if k.startswith("duet_instance_up{"))


class RankRejoinTest(unittest.TestCase):
    def test_a_stopped_rank_rejoins_as_a_member(self):
        serve_environment()  # SkipTest without the model
        expected = {p: generate(greedy(p)) for p in PROMPTS}
        workdir = tempfile.TemporaryDirectory()
        self.addCleanup(workdir.cleanup)
        key = os.path.join(workdir.name, "cluster.key")
        write_key(key, "a-test-cluster-key-of-at-least-32-bytes-0123456789")
        server = MpirunServe(3, ["--mode", "colocated", "--kv-cache-mem", "64MiB",
                                 "--instance-lease", "1", "--join-port", str(free_port()),
                                 "--cluster-key", key],
                             mpirun_args=["--enable-recovery"])
        server.start()
        self.addCleanup(server.stop, 30.0, False)
        try:
            stopped = server.rank_pids()[2]
            streams = start_sse(server, [greedy(PROMPTS[i % 4]) for i in range(6)])
            os.kill(stopped, signal.SIGSTOP)
            wait_until(lambda: metrics(server)["duet_instances_lost"] >= 1, 60,
                       "the stopped rank to count lost")
            check_texts(self, streams, expected, 180)
            os.kill(stopped, signal.SIGCONT)
            wait_until(lambda: metrics(server).get("duet_instances_joined_total", 0) >= 1 and
                       instances_up(server) == 2, 90, "the woken rank to rejoin as a member")
            log = "\n".join(server.log_lines())
            self.assertIn("rejoining the cluster at 127.0.0.1:", log)
            self.assertIn("(both, joined): serving", log)
            self.assertEqual(server.rank_pids().get(2), stopped)  # the same process
            # Routed to again: 8 requests over two instances, the rejoined one included.
            check_texts(self, start_sse(server, [greedy(PROMPTS[i % 4]) for i in range(8)]),
                        expected, 180)
        except AssertionError:
            print("\n".join(server.log_lines()[-80:]), flush=True)
            raise
        stop_every_rank(server, timeout=60)


if __name__ == "__main__":
    unittest.main(verbosity=2)
