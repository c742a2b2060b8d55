"""`duet-client` as a user runs it, against the real `duet serve`.

generate streams only the text to stdout and the timings to stderr; chat
answers each stdin line; info and stats print; a refused request is one line
on stderr and exit 2; an unreachable server is exit 1; Ctrl-C cancels the
request on the server (exit 130). Run by ctest with DUET_BINARY, DUET_CLIENT
and DUET_MODEL set.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_process import start_shared, stop_shared  # noqa: E402

server = None
client_binary = None


def setUpModule():
    global server, client_binary
    client_binary = os.environ.get("DUET_CLIENT")
    if not client_binary or not os.path.exists(client_binary):
        raise RuntimeError(f"DUET_CLIENT must name the duet-client binary (got {client_binary!r})")
    server = start_shared(["--kv-cache-mem", "256MiB"])


def tearDownModule():
    stop_shared(server)


def rpc_address():
    return f"{server.rpc_host}:{server.rpc_port}"


def client(*args, stdin_text=None, address=None):
    """Runs `duet-client --connect ADDRESS ARGS...` to its end."""
    return subprocess.run([client_binary, "--connect", address or rpc_address(), *args],
                          input=stdin_text,
                          stdin=None if stdin_text is not None else subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def stats():
    run = client("stats")
    assert run.returncode == 0, run.stderr
    return dict((k, int(v)) for k, v in (line.split() for line in run.stdout.splitlines()))


class ClientCliTest(unittest.TestCase):
    def test_generate_streams_text_and_timings(self):
        run = client("generate", "--prompt", "Once upon a time", "-n", "8", "--ignore-eos")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertTrue(run.stdout.strip(), run.stdout)
        self.assertTrue(run.stdout.endswith("\n"))
        self.assertIn("finish: length", run.stderr)
        self.assertIn("completion 8 tokens", run.stderr)
        self.assertIn("TTFT", run.stderr)
        # Greedy: the same text again.
        again = client("generate", "--prompt", "Once upon a time", "-n", "8", "--ignore-eos")
        self.assertEqual(again.stdout, run.stdout)

    def test_generate_chat_prompt(self):
        run = client("generate", "--chat", "--prompt", "What is the capital of France?", "-n", "16")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertTrue(run.stdout.strip())

    def test_chat_answers_each_line(self):
        run = client("chat", "-n", "6", "--ignore-eos", stdin_text="Hi!\nWhat is 2+2?\n")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertGreaterEqual(run.stdout.count("\n"), 2, run.stdout)

    def test_info_and_stats(self):
        run = client("info")
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("vocab_size 49152", run.stdout)
        s = stats()
        self.assertGreater(s["kv_blocks_total"], 0)
        self.assertEqual(s["draining"], 0)
        run = client("health")
        self.assertEqual((run.returncode, run.stdout), (0, "ok\n"), run.stderr)

    def test_refused_request_is_one_line_and_exit_2(self):
        run = client("generate", "--prompt", "")
        self.assertEqual(run.returncode, 2)
        self.assertEqual(run.stderr.count("\n"), 1, run.stderr)
        self.assertIn("invalid_argument", run.stderr)
        self.assertEqual(run.stdout, "")

    def test_set_role_needs_a_cluster_and_its_key(self):
        # A single-process server has no cluster key: the admin call is refused in one line.
        with tempfile.TemporaryDirectory() as tmp:
            key = os.path.join(tmp, "cluster.key")
            with open(key, "w") as f:
                f.write("a-test-cluster-key-of-at-least-32-bytes-0123456789\n")
            os.chmod(key, 0o600)
            run = client("set-role", "--instance", "0", "--role", "decode", "--cluster-key", key)
            self.assertEqual(run.returncode, 2, run.stderr)
            self.assertEqual(run.stderr, "duet-client: unauthenticated: this server takes no admin "
                                         "calls: it was started without --cluster-key FILE\n")
            os.chmod(key, 0o644)  # open to others: refused before anything is sent
            run = client("set-role", "--instance", "0", "--role", "decode", "--cluster-key", key)
            self.assertEqual(run.returncode, 2, run.stderr)
            self.assertIn("invalid_argument", run.stderr)
        run = client("set-role", "--instance", "0", "--role", "router", "--cluster-key", "k")
        self.assertEqual(run.returncode, 2)
        self.assertEqual(run.stderr.count("\n"), 1, run.stderr)

    def test_bad_flags_exit_2(self):
        run = client("generate", "--prompt", "x", "--no-such-flag")
        self.assertEqual(run.returncode, 2)
        self.assertEqual(run.stderr.count("\n"), 1, run.stderr)

    def test_unreachable_server_exits_1(self):
        # A port nobody listens on: bind one, close it, connect to it.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        run = client("info", address=f"127.0.0.1:{port}")
        self.assertEqual(run.returncode, 1)
        self.assertEqual(run.stderr.count("\n"), 1, run.stderr)
        self.assertIn("connection", run.stderr)

    def test_ctrl_c_cancels_on_the_server(self):
        process = subprocess.Popen(
            [client_binary, "--connect", rpc_address(), "generate", "--prompt",
             "Tell me a long story.", "-n", "3000", "--ignore-eos"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        process.stdout.read(1)  # generating
        process.send_signal(signal.SIGINT)
        _out, err = process.communicate(timeout=60)
        self.assertEqual(process.returncode, 130, err)
        self.assertIn("finish: cancelled", err)
        deadline = time.monotonic() + 10
        while True:
            s = stats()
            if s["running_sequences"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
                break
            self.assertLess(time.monotonic(), deadline, s)
            time.sleep(0.02)


if __name__ == "__main__":
    unittest.main()
