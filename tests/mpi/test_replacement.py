"""launch/local.sh keeps its instance count: a lost instance is replaced;
with --rebalance auto and DUET_MAX_EXTRA the count follows the load.

`launch/local.sh 0 2 --mode colocated` (the coordinator and two colocated
instances under mpirun --enable-recovery, the default lease) serves; rank 1
is SIGKILLed while streams run on both instances. Every stream finishes with
the text single-process `duet generate` gives (the coordinator re-runs what
the lost instance held); the launcher starts a replacement that joins
(`duet serve --join`), and /metrics shows two instances up again, one of
them joined. The time from the kill to the replacement serving is printed
(the README's figure). SIGTERM to the launcher then drains and stops the
cluster, the replacement included, with exit code 0.

test_c_a_lost_decode_instance_is_replaced: the same in `launch/local.sh 1 1`
(disaggregated): rank 2, the decode instance, is SIGKILLed; the replacement
joins as a decode instance, its KV linked with the prefill rank.

test_d_a_lost_tensor_parallel_instance_is_replaced: the same with the
decode instance of two ranks (`--decode-tp 2`): its replacement is an
instance of two ranks, an mpirun job of its own.

test_b_counts_follow_the_load: one colocated instance misses a 5 ms TTFT
target under load; the coordinator publishes that it wants two, the
launcher starts a joined instance, answers stay `duet generate`'s; once idle
the coordinator wants one, and the joined instance is asked to leave.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import BackToBack, SseStream, complete, metrics, wait_until  # noqa: E402
from test_failover import generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first"]


def tagged(tag, rank):
    """The pid of the process of `rank` whose environment carries `tag`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (f"DUET_TEST_TAG={tag}".encode() in env and
                f"OMPI_COMM_WORLD_RANK={rank}".encode() in env):
            return int(pid)
    return None


class Cluster:
    """launch/local.sh as a subprocess: its stdout's listening lines, its stderr kept."""

    def __init__(self, *args, env=None):
        binary, model = serve_environment()
        self.tag = uuid.uuid4().hex
        env = {**os.environ, "DUET_SKIP_SETUP": "1", "DUET_SKIP_BUILD": "1",
               "DUET_BINARY": binary, "DUET_MODEL": model, "DUET_TEST_TAG": self.tag,
               "DUET_MPIRUN": os.environ.get("DUET_MPIEXEC", "mpirun"), **(env or {})}
        self.process = subprocess.Popen(["bash", os.path.join(ROOT, "launch", "local.sh"), *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, errors="replace", env=env)
        self.log = []
        self.http = None
        threading.Thread(target=self._read_stderr, daemon=True).start()
        for line in self.process.stdout:
            match = re.match(r"http listening on (\S+):(\d+)", line.strip())
            if match:
                self.http_port = int(match.group(2))
                self.http_url = f"http://127.0.0.1:{self.http_port}"
                break
        if not hasattr(self, "http_url"):
            raise AssertionError("the launcher never listened:\n" + "\n".join(self.log[-40:]))

    def _read_stderr(self):
        for line in self.process.stderr:
            self.log.append(line.rstrip("\n"))

    def stop(self, timeout=120):
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout)
        self.process.stdout.close()
        time.sleep(0.5)  # the stderr reader reaches the end
        self.process.stderr.close()
        return code


class ReplacementTest(unittest.TestCase):
    def replace_under_load(self, cluster, rank, role):
        """SIGKILLs `rank` while 8 streams run: every one ends with `duet generate`'s text,
        a replacement of `role` joins, two instances are up again and answer the same."""
        expected = {p: generate({"prompt": p, "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True}) for p in PROMPTS}
        try:
            wait_until(lambda: any("instances may join on port" in l for l in cluster.log), 30,
                       "the join port")
            streams = [SseStream("127.0.0.1", cluster.http_port,
                                 {"prompt": PROMPTS[i % 4], "max_tokens": 24, "temperature": 0,
                                  "ignore_eos": True, "stream": True}) for i in range(8)]
            for s in streams:
                s.start()
            wait_until(lambda: all(s.events > 0 for s in streams), 120, "every stream to start")
            victim = tagged(cluster.tag, rank)
            self.assertIsNotNone(victim, f"rank {rank}'s process")
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            for s in streams:
                s.join(180)
                self.assertIsNone(s.failure, s.failure)
                self.assertIsNone(s.error)
                self.assertEqual(s.text, expected[s.body["prompt"]])

            def mended():
                m = metrics(cluster)
                return (m.get("duet_instances_joined_total", 0) >= 1 and
                        sum(v for k, v in m.items() if k.startswith("duet_instance_up{")) >= 2)

            try:
                wait_until(mended, 120, "two instances up again, one of them a replacement")
            except AssertionError:
                print("\n".join(cluster.log[-80:]), flush=True)
                raise
            took = time.monotonic() - killed
            print(f"{role} replacement serving {took:.1f} s after the kill", flush=True)
            wait_until(lambda: any("replacement" in l and "serves:" in l for l in cluster.log),
                       10, "the launcher to say its replacement serves")
            self.assertTrue(any(f"replacement 1 ({role}," in l for l in cluster.log))
            self.assertTrue(any(f"({role}, joined): serving" in l for l in cluster.log))
            for p in PROMPTS:  # spread over both instances, the replacement included
                r = complete(cluster, {"prompt": p, "max_tokens": 24, "temperature": 0,
                                       "ignore_eos": True})
                self.assertEqual(r["choices"][0]["text"], expected[p])
        finally:
            code = cluster.stop()
        self.assertEqual(code, 0, "\n".join(cluster.log[-60:]))

    def test_a_lost_instance_is_replaced(self):
        self.replace_under_load(Cluster("0", "2", "--mode", "colocated", "--kv-cache-mem",
                                        "64MiB"), 1, "both")

    def test_c_a_lost_decode_instance_is_replaced(self):
        # 1P+1D: the replacement joins as a decode instance and links its KV
        # with the prefill rank; only it decodes from then on.
        self.replace_under_load(Cluster("1", "1", "--kv-cache-mem", "64MiB"), 2, "decode")

    def test_d_a_lost_tensor_parallel_instance_is_replaced(self):
        # 1P+1D with the decode instance on ranks 2 and 3: its leader killed,
        # the replacement is `mpirun -np 2 duet serve --join ... --tp 2`.
        self.replace_under_load(Cluster("1", "1", "--decode-tp", "2", "--kv-cache-mem", "64MiB"),
                                2, "decode")

    def test_b_counts_follow_the_load(self):
        # Prompts of a few hundred tokens, back to back from 4 clients, miss a
        # 5 ms TTFT target on one instance: the coordinator wants one more
        # (duet_cluster_instances_wanted) and the launcher starts it. Once
        # nothing runs, the coordinator wants one fewer and the joined
        # instance is asked to leave, and drains.
        # The prefix cache holds all 4 prompts, so a first token costs a step
        # or two, not a prompt's prefill: under 100 ms on an idle machine.
        # 5 ms is less than one step of the model on any CPU we run on.
        prompts = [p + " " + " ".join([p] * 40) for p in PROMPTS]

        def body(p):
            return {"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

        expected = {p: generate(body(p)) for p in prompts}
        cluster = Cluster("0", "1", "--mode", "colocated", "--kv-cache-mem", "64MiB",
                          "--rebalance", "auto", "--slo", "ttft=5", env={"DUET_MAX_EXTRA": "1"})

        def up():
            m = metrics(cluster)
            return sum(v for k, v in m.items() if k.startswith("duet_instance_up{"))

        try:
            load = BackToBack(cluster, prompts, body, expected, 4)
            try:
                wait_until(lambda: up() >= 2, 180, "a joined instance for the load")
                wait_until(lambda: any("joined instance" in l and "serves:" in l
                                       for l in cluster.log), 30, "the launcher to say it serves")
                time.sleep(3)  # requests on both
            except AssertionError:
                print("\n".join(cluster.log[-80:]), flush=True)
                raise
            finally:
                load.stop()
            self.assertEqual(load.failures, [])
            m = metrics(cluster)
            self.assertEqual(m["duet_instances_joined_total"], 1)  # DUET_MAX_EXTRA=1: no third
            # The joined one may be leaving already: once nothing runs, or once
            # both are under half the target, the load wants one fewer.
            self.assertLessEqual(up(), 2)
            wait_until(lambda: any("asked to leave" in l for l in cluster.log), 90,
                       "the launcher to ask the joined instance to leave once idle")
            wait_until(lambda: up() == 1 and metrics(cluster)["duet_instances_left_total"] == 1,
                       60, "the joined instance to leave")
            r = complete(cluster, body(prompts[0]))
            self.assertEqual(r["choices"][0]["text"], expected[prompts[0]])
        finally:
            code = cluster.stop()
        self.assertEqual(code, 0, "\n".join(cluster.log[-60:]))


if __name__ == "__main__":
    unittest.main(verbosity=2)
