"""Instances that change role while the cluster serves (`duet-client set-role`).

A disaggregated cluster under mpirun: rank 0 the coordinator, rank 1 a
prefill instance, ranks 2 and 3 decode instances, with a cluster key. Then:

- test_1_refusals: a wrong key, a wrong instance, and a change that would
  leave nothing to decode are refused with one line (exit 2); the cluster
  keeps serving and no role changed.
- test_2_roles_change_under_load: while streams run, the prefill instance
  becomes decode, a decode instance becomes prefill, the other decode
  instance becomes colocated (both); each change waits for its instance's
  work, and every stream, and every request sent after each change, is the
  single-process `duet generate`'s text. /health, /metrics and
  `duet-client stats` show the new roles and the count of changes; once idle
  every KV block is free again.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (check_texts, complete, end_module, every_block_free,  # noqa: E402
                          http_request, metrics, start_cluster, start_sse, wait_until, write_key)
from test_failover import generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "To make bread, first", "The three primary colors are", "A haiku about the sea:"]
MAX_TOKENS = 32

cluster = None
workdir = None
key_file = None
expected = {}


def greedy(prompt):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def setUpModule():
    global cluster, workdir, key_file
    serve_environment()  # SkipTest without the model
    workdir = tempfile.TemporaryDirectory()
    key_file = os.path.join(workdir.name, "cluster.key")
    write_key(key_file, "a-test-cluster-key-of-at-least-32-bytes-0123456789")
    for prompt in PROMPTS:
        expected[prompt] = generate(greedy(prompt))
    cluster = start_cluster(4, ["--prefill", "1", "--decode", "2", "--kv-cache-mem", "64MiB",
                                "--cluster-key", key_file])


def tearDownModule():
    end_module(cluster, workdir)


def client(*args, key=None):
    """(exit code, stdout, stderr) of `duet-client --connect RPC ARGS...`."""
    binary, _ = serve_environment()
    command = [os.path.join(os.path.dirname(binary), "duet-client"), "--connect",
               f"{cluster.rpc_host}:{cluster.rpc_port}", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout, result.stderr


def set_role(instance, role, key=None):
    return client("set-role", "--instance", str(instance), "--role", role,
                  "--cluster-key", key or key_file)


def roles():
    """Each instance's role, and the one it waits to take ("" if none), from duet-client stats."""
    code, out, err = client("stats")
    assert code == 0, err
    found = []
    for line in out.splitlines():
        if line.startswith("instance "):
            words = line.split()
            found.append((words[2], words[-1] if "switching to" in line else ""))
    return found


def check_answers(test, streams):
    check_texts(test, streams, expected)


def run_streams(n):
    streams = start_sse(cluster, [greedy(PROMPTS[i % len(PROMPTS)]) for i in range(n)])
    wait_until(lambda: all(s.events >= 2 or s.done for s in streams), 120,
               "tokens on every stream")
    return streams


def check_plain_requests(test):
    for prompt in PROMPTS[:3]:
        r = complete(cluster, greedy(prompt))
        test.assertEqual(r["choices"][0]["text"], expected[prompt], prompt)


class RoleChangeTest(unittest.TestCase):
    def test_1_refusals(self):
        other_key = os.path.join(workdir.name, "other.key")
        write_key(other_key, "another-cluster-key-of-at-least-32-bytes-abcdefghij")
        cases = [
            ((0, "decode", other_key), "unauthenticated: the cluster key does not match"),
            ((7, "decode", None), "invalid_argument: instance 7 cannot become decode: the "
                                  "cluster has instances 0 to 2"),
        ]
        for (instance, role, key), says in cases:
            code, out, err = set_role(instance, role, key)
            self.assertEqual(code, 2, err)
            self.assertEqual(err.strip(), f"duet-client: {says}")
        # Both decode instances to prefill: the second would leave none to decode.
        code, out, err = set_role(1, "prefill")
        self.assertEqual(code, 0, err)
        code, out, err = set_role(2, "prefill")
        self.assertEqual(code, 2, err)
        self.assertIn("no live instance would be left to decode", err)
        code, out, err = set_role(1, "decode")  # back
        self.assertEqual(code, 0, err)
        self.assertEqual(roles(), [("prefill", ""), ("decode", ""), ("decode", "")])
        check_plain_requests(self)
        wait_until(lambda: every_block_free(cluster), 30, "every KV block free")

    def test_2_roles_change_under_load(self):
        changes = int(metrics(cluster)["duet_instance_role_changes_total"])
        streams = run_streams(8)
        # The prefill instance becomes decode: it finishes the prompts it holds first.
        code, out, err = set_role(0, "decode")
        self.assertEqual(code, 0, err)
        self.assertRegex(out, r"instance 0 (is now decode|becomes decode)")
        wait_until(lambda: roles()[0] == ("decode", ""), 120, "instance 0 to decode")
        # A decode instance becomes prefill once its streams are done.
        code, out, err = set_role(1, "prefill")
        self.assertEqual(code, 0, err)
        more = run_streams(6)  # placed around instance 1 while it waits, then on the new roles
        wait_until(lambda: roles()[1] == ("prefill", ""), 180, "instance 1 to prefill")
        check_answers(self, streams)
        # The other decode instance becomes colocated (both) under load.
        code, out, err = set_role(2, "both")
        self.assertEqual(code, 0, err)
        check_answers(self, more)
        wait_until(lambda: roles()[2] == ("both", ""), 120, "instance 2 to both")
        self.assertEqual(roles(), [("decode", ""), ("prefill", ""), ("both", "")])
        # Every kind of route now: prompts shipped from 1 to 0, whole requests on 2.
        check_answers(self, run_streams(6))
        check_plain_requests(self)
        m = metrics(cluster)
        self.assertEqual(int(m["duet_instance_role_changes_total"]), changes + 3)
        status, _, body = http_request(cluster.http_url + "/health")
        self.assertEqual(status, 200)
        self.assertIn(f'"role_changes":{changes + 3}', body.decode())
        self.assertEqual(m["duet_requests_failed_after_retries_total"], 0)
        wait_until(lambda: every_block_free(cluster), 30, "every KV block free")
        log = "\n".join(cluster.log_lines())
        self.assertIn("instance 1: now prefill (was decode)", log)


if __name__ == "__main__":
    unittest.main()
