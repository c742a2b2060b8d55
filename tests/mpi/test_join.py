"""Instances that join a running cluster and leave it (`duet serve --join`).

A colocated cluster of one instance under mpirun (rank 0 the coordinator,
rank 1 the instance) opens --join-port 0 with a cluster key. Then:

- test_1_bad_joins: a joiner with another key, with another model (a
  synthetic one the generator writes), or with a role a colocated cluster
  does not take, exits non-zero with a one-line reason; the coordinator logs
  one line for each; one of two ranks started without mpirun is refused
  before it dials; the cluster keeps serving.
- test_2_join_serve_leave: a plain process joins; /health counts it, and
  requests go to it (its own log counts the tokens it made): every text is
  the single-process `duet generate`'s. Streams in flight on it when it gets
  SIGTERM finish whole and equal; it exits 0; /health and /metrics say it
  left; new requests are still served.
- test_3_killed_member: a joined instance SIGKILLed while streams run on it
  is lost (its connection ends): every stream finishes with the same text.
- test_4_join_from_mpirun: a one-rank mpirun job of its own joins as well,
  and so does an instance of two ranks (`mpirun -np 2 ... --tp 2`), which
  leaves when its leader gets SIGTERM.
- test_5_stopped_member_rejoins: a joined instance SIGSTOPped past its lease
  is lost; woken, it rejoins as a new member and serves again.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (MPIRUN_FLAGS, check_texts, complete, end_module,  # noqa: E402
                          http_request, metrics, rank_pids, start_cluster,
                          start_sse, wait_until, write_key)
from test_failover import generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first"]

cluster = None
workdir = None
key_file = None
join_address = None
expected = {}


def setUpModule():
    global cluster, workdir, key_file, join_address
    serve_environment()  # SkipTest without the model
    workdir = tempfile.TemporaryDirectory()
    key_file = os.path.join(workdir.name, "cluster.key")
    write_key(key_file, "a-test-cluster-key-of-at-least-32-bytes-0123456789")
    for prompt in PROMPTS:
        expected[prompt] = generate({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                     "ignore_eos": True})
    cluster = start_cluster(2, ["--mode", "colocated", "--kv-cache-mem", "64MiB",
                                "--join-port", "0", "--cluster-key", key_file])
    join_address = f"127.0.0.1:{listening_port(cluster)}"


def tearDownModule():
    end_module(cluster, workdir)


def listening_port(server):
    """The port the cluster's coordinator takes joins on (--join-port 0: from its log)."""
    port = None

    def listening():
        nonlocal port
        for line in server.log_lines():
            match = re.search(r"instances may join on port (\d+)", line)
            if match:
                port = int(match.group(1))
        return port is not None

    wait_until(listening, 30, "the join listener's port")
    return port


class Joiner:
    """`duet serve --join` (optionally under an mpirun of its own), its output
    collected in a file."""

    def __init__(self, *extra, model=None, key=None, mpirun=False):
        binary, default_model = serve_environment()
        self.log_path = os.path.join(workdir.name, f"joiner-{time.monotonic_ns()}.log")
        command = [binary, "serve", "--model", model or default_model, "--join", join_address,
                   "--cluster-key", key or key_file, "--threads", "1",
                   "--kv-cache-mem", "64MiB", *extra]
        if mpirun:  # True: one rank; a number: that many
            command = [os.environ.get("DUET_MPIEXEC", "mpirun"), *MPIRUN_FLAGS, "-np",
                       str(int(mpirun)), *command]
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait(self, timeout):
        try:
            return self.process.wait(timeout)
        finally:
            self.log.close()

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log.close()


def health():
    status, _, body = http_request(cluster.http_url + "/health")
    return status, body.decode()


def joins():
    return int(metrics(cluster)["duet_instances_joined_total"])


def wait_joined(joiner, n_joins):
    """Until the coordinator counts n_joins, and the joiner says it serves."""
    def ready():
        if joiner.process.poll() is not None:
            raise AssertionError(f"the joiner exited:\n{joiner.text()}")
        return joins() >= n_joins and "(both, joined): serving" in joiner.text()
    wait_until(ready, 120, "the joined instance to serve")


def greedy(prompt):
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}


def run_streams(n):
    return start_sse(cluster, [greedy(PROMPTS[i % len(PROMPTS)]) for i in range(n)])


def check_streams(test, streams, timeout=180):
    check_texts(test, streams, expected, timeout)


class JoinTest(unittest.TestCase):
    def test_1_bad_joins(self):
        other_key = os.path.join(workdir.name, "other.key")
        write_key(other_key, "another-cluster-key-of-at-least-32-bytes-abcdefghij")
        other_model = os.path.join(workdir.name, "other.gguf")
        subprocess.run([sys.executable, os.path.join(HERE, "..", "gpu", "synthetic_model.py"),
                        "--shape", "smollm2-135m", "--type", "q4_0", "--layers", "1",
                        "--out", other_model], check=True, capture_output=True, timeout=300)
        cases = [
            ((), {"key": other_key}, "did not prove the cluster key",
             "closed the connection instead of proving the cluster key"),
            ((), {"model": other_model}, "refused: it serves another model",
             "refused .*it serves another model"),
            (("--role", "decode"), {}, "refused: the cluster is colocated",
             "refused .*the cluster is colocated"),
        ]
        for extra, kwargs, joiner_says, coordinator_says in cases:
            joiner = Joiner(*extra, **kwargs)
            code = joiner.wait(120)
            text = joiner.text()
            self.assertNotEqual(code, 0, text)
            self.assertIn(joiner_says, text)
            self.assertEqual(len([l for l in text.splitlines() if l.startswith("duet: ")]), 1,
                             text)
            wait_until(lambda: any(re.search(coordinator_says, l) for l in cluster.log_lines()),
                       10, f"the coordinator to log {coordinator_says!r}")
        # An instance of two ranks started without its mpirun: refused before it dials.
        joiner = Joiner("--tp", "2")
        self.assertNotEqual(joiner.wait(120), 0)
        self.assertIn("--tp 2 joins as a job of its own: mpirun -np 2", joiner.text())
        self.assertEqual(joins(), 0)
        self.assertEqual(health(), (200, '{"status":"ok"}'))
        r = complete(cluster, greedy(PROMPTS[0]))
        self.assertEqual(r["choices"][0]["text"], expected[PROMPTS[0]])

    def test_2_join_serve_leave(self):
        joiner = Joiner()
        try:
            wait_joined(joiner, 1)
            status, body = health()
            self.assertEqual(status, 200)
            self.assertEqual(body,
                             '{"status":"ok","lost_instances":0,"instances":2,"joined":1,"left":0}')
            # Enough at once that the router, which prefers free KV, sends
            # some to the joined instance.
            check_streams(self, run_streams(8))
            # Streams in flight on both instances when the joiner is told to go.
            streams = run_streams(8)
            wait_until(lambda: all(s.events > 0 for s in streams), 120, "every stream to start")
            joiner.process.send_signal(signal.SIGTERM)
            check_streams(self, streams)
            self.assertEqual(joiner.wait(60), 0, joiner.text())
            text = joiner.text()
            self.assertIn("leaving the cluster", text)
            made = re.search(r"instance \d+: drained \(\d+ steps, (\d+) tokens generated\)", text)
            self.assertIsNotNone(made, text)
            self.assertGreater(int(made.group(1)), 0, "no request went to the joined instance")
            self.assertEqual(health(), (200, '{"status":"ok","lost_instances":0,"instances":2,'
                                             '"joined":1,"left":1}'))
            m = metrics(cluster)
            self.assertEqual(m["duet_instances_left_total"], 1)
            self.assertEqual(m["duet_instances_lost"], 0)
            check_streams(self, run_streams(2))
        finally:
            joiner.kill()

    def test_3_killed_member(self):
        joiner = Joiner()
        try:
            wait_joined(joiner, 2)
            streams = run_streams(8)
            wait_until(lambda: all(s.events > 0 for s in streams), 120, "every stream to start")
            joiner.process.kill()
            check_streams(self, streams)
            wait_until(lambda: metrics(cluster)["duet_instances_lost"] == 1, 30,
                       "the killed member to count lost")
            # One instance up, as many as the cluster started with: a loss
            # made up for is no degradation.
            self.assertEqual(health(), (200, '{"status":"ok","lost_instances":1,"instances":3,'
                                             '"joined":2,"left":1}'))
        finally:
            joiner.kill()

    def test_4_join_from_mpirun(self):
        joiner = Joiner(mpirun=True)
        try:
            wait_joined(joiner, 3)
            check_streams(self, run_streams(4))
            # To the rank, as a scheduler stopping that job's process would
            # (mpirun, signalled itself, exits 1 whatever its ranks do).
            os.kill(rank_pids(joiner.process.pid)[0], signal.SIGTERM)
            self.assertEqual(joiner.wait(60), 0, joiner.text())
            self.assertIn("drained", joiner.text())
        finally:
            joiner.kill()
        group = Joiner("--tp", "2", mpirun=2)
        try:
            wait_joined(group, 4)
            self.assertIn("compute threads, tp 2", group.text())
            check_streams(self, run_streams(8))
            os.kill(rank_pids(group.process.pid)[0], signal.SIGTERM)  # to its leader
            self.assertEqual(group.wait(60), 0, group.text())
            made = re.search(r"instance \d+: drained \(\d+ steps, (\d+) tokens generated\)",
                             group.text())
            self.assertIsNotNone(made, group.text())
            self.assertGreater(int(made.group(1)), 0, "no request went to the joined group")
        finally:
            group.kill()

    def test_5_stopped_member_rejoins(self):
        joiner = Joiner()
        try:
            wait_joined(joiner, 5)
            joiner.process.send_signal(signal.SIGSTOP)
            lost_before = metrics(cluster)["duet_instances_lost"]
            wait_until(lambda: metrics(cluster)["duet_instances_lost"] > lost_before, 30,
                       "the stopped member to count lost")
            joiner.process.send_signal(signal.SIGCONT)
            # It learns it was lost and joins again as a new member.
            wait_until(lambda: joins() >= 6 and "rejoining the cluster" in joiner.text(), 60,
                       "the member to rejoin")
            wait_until(lambda: joiner.text().count("(both, joined): serving") >= 2, 60,
                       "the rejoined member to serve")
            m = metrics(cluster)
            self.assertEqual(sum(v for k, v in m.items() if k.startswith("duet_instance_up{")), 2)
            check_streams(self, run_streams(4))
            joiner.process.send_signal(signal.SIGTERM)
            self.assertEqual(joiner.wait(60), 0, joiner.text())
        finally:
            joiner.kill()


if __name__ == "__main__":
    unittest.main(verbosity=2)
