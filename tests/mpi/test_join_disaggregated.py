"""Prefill and decode instances that join a running disaggregated cluster.

Each test starts a cluster of one prefill and one decode instance under
mpirun (rank 0 the coordinator, rank 1 prefill, rank 2 decode,
--enable-recovery) that takes joins with a cluster key. A joined prefill or
decode instance links its KV with every instance rank over TCP, each link
proving the key (worker/transfer/kv_member_links.h). Every answer is
compared with `duet generate`'s.

- test_a_prefill_member_feeds_the_decode_rank: a colocated joiner is
  refused with one line on both sides. A prefill member joins; the job's
  prefill rank is SIGKILLed while streams run: every stream ends equal,
  prefilled by the member from then on, its KV shipped to the job's decode
  rank (member to job).
- test_b_decode_member_then_rejoined_prefill_rank: a decode member joins;
  the job's decode rank is SIGKILLed while streams run: every stream ends
  equal, the job's prefill rank shipping KV to the member (job to member).
  A prefill member joins; the job's prefill rank is SIGSTOPped past its
  lease: streams go on between the two members (member to member); woken,
  the rank rejoins as a prefill member, links with the decode member and is
  routed to again. Every member leaves on SIGTERM with exit code 0, and no
  KV block stays held.
- test_c_tensor_parallel_members: members of two ranks each, every one an
  mpirun job of its own (`mpirun -np 2 duet serve --join ... --tp 2`): a
  decode group stands in for the killed decode rank (the prefill rank ships
  each group rank its KV heads), then a prefill group for the stopped
  prefill rank (group to group: the decode group learns the prefill group's
  ranks from each request; its follower hears of the stopped rank through
  its leader). Both leave on SIGTERM to their leader.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import re
import signal
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (MpirunServe, check_texts, complete, every_block_free,  # noqa: E402
                          metrics, rank_pids, start_sse, wait_until, write_key)
from test_failover import generate  # noqa: E402
from test_join import Joiner, greedy, listening_port  # noqa: E402
from test_rank_rejoin import free_port  # noqa: E402
import test_join  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first"]
expected = {}


def setUpModule():
    serve_environment()  # SkipTest without the model
    for prompt in PROMPTS:
        expected[prompt] = generate(greedy(prompt))


def joins(cluster):
    return int(metrics(cluster)["duet_instances_joined_total"])


def lost(cluster):
    return int(metrics(cluster)["duet_instances_lost"])


def instances_up(cluster):
    return sum(v for k, v in metrics(cluster).items() if k.startswith("duet_instance_up{"))


def wait_serving(cluster, joiner, role, n_joins):
    def ready():
        if joiner.process.poll() is not None:
            raise AssertionError(f"the joiner exited:\n{joiner.text()}")
        return joins(cluster) >= n_joins and f"({role}, joined): serving" in joiner.text()
    wait_until(ready, 120, f"the joined {role} instance to serve")


def run_streams(cluster, n):
    return start_sse(cluster, [greedy(PROMPTS[i % len(PROMPTS)]) for i in range(n)])


def steps_and_tokens(joiner):
    made = re.search(r"instance \d+: drained \((\d+) steps, (\d+) tokens generated\)",
                     joiner.text())
    assert made, joiner.text()
    return int(made.group(1)), int(made.group(2))


class JoinDisaggregatedTest(unittest.TestCase):
    def start(self, join_port="0"):
        """A 1P+1D cluster taking joins; test_join's Joiner pointed at it."""
        workdir = tempfile.TemporaryDirectory()
        self.addCleanup(workdir.cleanup)
        key_file = os.path.join(workdir.name, "cluster.key")
        write_key(key_file, "a-test-cluster-key-of-at-least-32-bytes-0123456789")
        cluster = MpirunServe(3, ["--prefill", "1", "--decode", "1", "--kv-cache-mem", "64MiB",
                                  "--join-port", join_port, "--cluster-key", key_file],
                              mpirun_args=["--enable-recovery"])
        cluster.start()
        self.addCleanup(self.stop, cluster)
        test_join.workdir = workdir
        test_join.key_file = key_file
        test_join.join_address = f"127.0.0.1:{listening_port(cluster)}"
        return cluster

    def stop(self, cluster):
        # Ranks of the job were killed: only the coordinator's exit is judged.
        if cluster.process.poll() is None:
            cluster.stop(timeout=60, check=False)
        log = "\n".join(cluster.log_lines())
        self.assertIn("rank 0: exiting with code 0", log)

    def joiner(self, *args, mpirun=False):
        joiner = Joiner(*args, mpirun=mpirun)
        self.addCleanup(joiner.kill)
        return joiner

    def lose_under_load(self, cluster, pid, sig, n_lost):
        """`sig` to `pid` while 8 streams run: every one ends equal; n_lost instances lost."""
        streams = run_streams(cluster, 8)
        wait_until(lambda: all(s.events > 0 for s in streams), 120, "every stream to start")
        os.kill(pid, sig)
        check_texts(self, streams, expected, 180)
        wait_until(lambda: lost(cluster) == n_lost, 30, f"{n_lost} instance(s) to count lost")

    def assert_no_reruns(self, cluster, run):
        """`run` served every request on its first try: no link was missing."""
        before = metrics(cluster)["duet_request_reruns_total"]
        run()
        self.assertEqual(metrics(cluster)["duet_request_reruns_total"], before)
        self.assertNotIn("no connection to rank", "\n".join(cluster.log_lines()))

    def leave(self, *members):
        for member in members:
            member.process.send_signal(signal.SIGTERM)
        for member in members:
            self.assertEqual(member.wait(60), 0, member.text())

    def test_a_prefill_member_feeds_the_decode_rank(self):
        cluster = self.start()
        refused = self.joiner()  # --role both, the default
        self.assertNotEqual(refused.wait(120), 0, refused.text())
        self.assertIn("refused: the cluster is disaggregated: join with --role prefill or "
                      "--role decode", refused.text())
        self.assertEqual(
            len([l for l in refused.text().splitlines() if l.startswith("duet: ")]), 1)
        wait_until(lambda: any(re.search("refused .*the cluster is disaggregated", l)
                               for l in cluster.log_lines()), 10, "the coordinator's line")
        self.assertEqual(joins(cluster), 0)

        prefill = self.joiner("--role", "prefill")
        wait_serving(cluster, prefill, "prefill", 1)
        self.assertIn("KV links with 2 of 2 ranks", prefill.text())
        self.lose_under_load(cluster, cluster.rank_pids()[1], signal.SIGKILL, 1)
        # The member is the only prefill instance now.
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 8),
                                                           expected, 180))
        wait_until(lambda: every_block_free(cluster), 30, "every KV block to be free")
        self.leave(prefill)
        self.assertGreater(steps_and_tokens(prefill)[0], 0)

    def test_b_decode_member_then_rejoined_prefill_rank(self):
        cluster = self.start(join_port=str(free_port()))
        decode = self.joiner("--role", "decode")
        wait_serving(cluster, decode, "decode", 1)
        self.lose_under_load(cluster, cluster.rank_pids()[2], signal.SIGKILL, 1)
        # The job's prefill rank to the decode member.
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 4),
                                                           expected, 180))

        prefill = self.joiner("--role", "prefill")
        wait_serving(cluster, prefill, "prefill", 2)
        self.assertIn("KV links with 2 of 2 ranks", prefill.text())
        stopped = cluster.rank_pids()[1]
        self.lose_under_load(cluster, stopped, signal.SIGSTOP, 2)
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 4),
                                                           expected, 180))  # member to member

        os.kill(stopped, signal.SIGCONT)
        wait_until(lambda: joins(cluster) >= 3 and instances_up(cluster) == 3, 90,
                   "the woken rank to rejoin as a prefill member")
        log = "\n".join(cluster.log_lines())
        self.assertIn("(prefill, joined): serving", log)
        self.assertEqual(cluster.rank_pids().get(1), stopped)  # the same process
        # With the decode member and the other prefill member (any may change role).
        self.assertIn("KV links with 2 of 2 ranks", log.split("rejoining the cluster")[-1])
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 8),
                                                           expected, 180))
        wait_until(lambda: every_block_free(cluster), 30, "every KV block to be free")
        self.leave(prefill, decode)
        self.assertGreater(steps_and_tokens(decode)[1], 0)

    def test_c_tensor_parallel_members(self):
        cluster = self.start()
        decode = self.joiner("--role", "decode", "--tp", "2", mpirun=2)
        wait_serving(cluster, decode, "decode", 1)
        self.assertIn("tp 2", decode.text())
        self.assertEqual(decode.text().count("KV links with 2 of 2 ranks"), 2, decode.text())
        self.lose_under_load(cluster, cluster.rank_pids()[2], signal.SIGKILL, 1)
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 4),
                                                           expected, 180))

        prefill = self.joiner("--role", "prefill", "--tp", "2", mpirun=2)
        wait_serving(cluster, prefill, "prefill", 2)
        # The prefill rank and the decode group's two (rank 2 is lost).
        self.assertEqual(prefill.text().count("KV links with 3 of 3 ranks"), 2, prefill.text())
        stopped = cluster.rank_pids()[1]
        started = time.monotonic()
        self.lose_under_load(cluster, stopped, signal.SIGSTOP, 2)
        print(f"streams over the stopped prefill rank done in {time.monotonic() - started:.1f} s",
              flush=True)
        self.assert_no_reruns(cluster, lambda: check_texts(self, run_streams(cluster, 8),
                                                           expected, 180))
        wait_until(lambda: every_block_free(cluster), 30, "every KV block to be free")
        # Both ranks of the decode group stopped waiting on the stopped rank:
        # the leader heard of it, and told its follower (which has no link to
        # the coordinator) ahead of its next command.
        self.assertEqual(decode.text().count("kv transfer: rank 1: lost, says the coordinator"), 2,
                         decode.text())
        os.kill(stopped, signal.SIGKILL)
        for group in (prefill, decode):
            os.kill(rank_pids(group.process.pid)[0], signal.SIGTERM)  # to the leader
        for group in (prefill, decode):
            self.assertEqual(group.wait(60), 0, group.text())
            self.assertIn("drained", group.text())
        self.assertGreater(steps_and_tokens(decode)[1], 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
