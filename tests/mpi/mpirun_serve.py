"""`mpirun -np N duet serve ...` as a subprocess, for the cluster serving tests.

Like tests/serve/serve_process.py's ServeProcess (which it extends: the same
port lines, log tail and HTTP helpers), but the command is mpirun's, and
stop() sends SIGTERM to rank 0 (the coordinator) rather than to mpirun:
signalled itself, mpirun reports failure (exit 1) and kills every rank one
second later, while rank 0's orderly shutdown ends every rank with exit 0,
so mpirun's own exit code then says whether every rank exited 0.

DUET_MPIEXEC names mpirun (ctest sets it; default "mpirun").
"""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import ServeProcess, http_request, parse_metrics, serve_environment  # noqa: E402,F401

MPIRUN_FLAGS = ["--allow-run-as-root", "--oversubscribe"]


def rank_pids(mpirun_pid):
    """{rank: pid} of the processes mpirun started (its children, read from /proc)."""
    children = set()
    for task in os.listdir(f"/proc/{mpirun_pid}/task"):
        try:
            with open(f"/proc/{mpirun_pid}/task/{task}/children") as f:
                children.update(int(p) for p in f.read().split())
        except OSError:
            pass
    ranks = {}
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                for item in f.read().split(b"\0"):
                    if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                        ranks[int(item.split(b"=", 1)[1])] = pid
        except OSError:
            pass
    return ranks


class MpirunServe(ServeProcess):
    """`mpirun -np RANKS duet serve --model MODEL --http-port 0 --rpc-port 0 --threads 1 ARGS...`."""

    def __init__(self, ranks, args=(), startup_timeout=180.0, mpirun_args=()):
        super().__init__(args, startup_timeout)
        mpirun = os.environ.get("DUET_MPIEXEC", "mpirun")
        self.ranks = ranks
        self.command = [mpirun, *MPIRUN_FLAGS, *mpirun_args, "-np", str(ranks), *self.command]

    def rank_pids(self):
        return rank_pids(self.process.pid)

    def stop(self, timeout=30.0, check=True):
        """SIGTERM to rank 0, then waits for mpirun; returns mpirun's exit code."""
        if self.process is not None and self.process.poll() is None:
            coordinator = self.rank_pids().get(0)
            if coordinator is not None:
                os.kill(coordinator, signal.SIGTERM)
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass  # ServeProcess.stop signals mpirun itself, kills it, and says so
        return super().stop(timeout, check)

    def log_lines(self):
        return list(self._log)


class SseStream(threading.Thread):
    """One streaming completion (`body` is sent as is) read to its end over a
    raw socket: text, finish reason, error, the `duet` timings' retries, the
    arrival time of each piece of text. A failure to read it is kept in
    `failure` for the test to report."""

    def __init__(self, host, port, body, timeout=120.0):
        super().__init__(daemon=True)
        self.host, self.port, self.body, self.timeout = host, port, body, timeout
        self.text, self.finish, self.error, self.retries = "", None, None, None
        self.events = 0
        self.times = []  # when each piece of text arrived
        self.started = None
        self.done = False
        self.failure = None

    def run(self):
        try:
            self.started = time.monotonic()
            data = json.dumps(self.body).encode()
            with socket.create_connection((self.host, self.port), timeout=self.timeout) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                          + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                buffer = b""
                while not self.done:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise AssertionError("the stream ended without [DONE]")
                    buffer += chunk
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        self.on_event(event.decode())
        except Exception as e:  # reported by the test
            self.failure = e

    def on_event(self, event):
        for line in event.splitlines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                self.done = True
                return
            message = json.loads(payload)
            self.events += 1
            if "error" in message:
                self.error = message["error"]
                continue
            choice = message["choices"][0]
            if choice.get("text"):
                self.times.append(time.monotonic())
            self.text += choice.get("text", "")
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
            if "duet" in message:
                self.retries = message["duet"].get("retries")


def start_cluster(ranks, args):
    """A cluster a test module shares, started (its setUpModule); SkipTest without the model."""
    cluster = MpirunServe(ranks, args)
    cluster.start()
    return cluster


def stop_cluster(cluster):
    """For tearDownModule: stops the cluster unless it never started or a test stopped it."""
    if cluster is not None and cluster.process.poll() is None:
        cluster.stop(check=False)


def stop_every_rank(cluster, timeout):
    """SIGTERM to the coordinator; asserts that mpirun and every rank exited 0. The log."""
    code = cluster.stop(timeout=timeout, check=False)
    log = "\n".join(cluster.log_lines())
    if code != 0:
        raise AssertionError(f"mpirun exited with code {code}:\n{log}")
    for rank in range(cluster.ranks):
        if f"rank {rank}: exiting with code 0" not in log:
            raise AssertionError(f"rank {rank} did not exit with code 0:\n{log}")
    return log


def requests_routed(log):
    """{instance: requests} the coordinator logged at shutdown."""
    return {int(i): int(n) for i, n in
            re.findall(r"instance (\d) \(rank \d\): (\d+) requests routed", log)}


def words(n, seed):
    """n words drawn from a small vocabulary: a prompt of a chosen length."""
    rng = random.Random(seed)
    vocab = ["river", "stone", "quiet", "north", "lamp", "seven", "bright", "window", "garden",
             "copper", "winter", "echo", "harbor", "paper", "violet", "engine"]
    return " ".join(rng.choice(vocab) for _ in range(n))


def greedy_and_seeded(prompts, max_tokens):
    """Two completion bodies a prompt: greedy, and sampled with a seed of its own."""
    bodies = []
    for i, p in enumerate(prompts):
        bodies.append({"prompt": p, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True})
        bodies.append({"prompt": p, "max_tokens": max_tokens, "temperature": 0.9,
                       "seed": 100 + i, "top_p": 0.95, "ignore_eos": True})
    return bodies


def complete(server, body, expect=200, timeout=300):
    """POST /v1/completions; asserts the status and returns the parsed reply."""
    status, _, reply = http_request(server.http_url + "/v1/completions", "POST", body,
                                    timeout=timeout)
    assert status == expect, (status, reply[:500])
    return json.loads(reply)


def complete_all(server, bodies, timeout=300):
    """Every body's reply (or the AssertionError), all sent at once, one thread each."""
    results = [None] * len(bodies)

    def one(i):
        try:
            results[i] = complete(server, bodies[i], timeout=timeout)
        except AssertionError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


def metrics(server):
    """GET /metrics, parsed into {name: value}."""
    return parse_metrics(http_request(server.http_url + "/metrics")[2].decode())


def every_block_free(server):
    """Whether the cluster holds no sequence and every KV block is free."""
    m = metrics(server)
    return (m["duet_running_sequences"] == 0 and m["duet_waiting_sequences"] == 0 and
            m["duet_kv_blocks_free"] == m["duet_kv_blocks_total"])


def open_stream(server, body, timeout=60):
    """A raw socket that has sent POST /v1/completions with `body` (stream it; close to cancel)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=timeout)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_events(sock, n):
    """Reads a stream until it delivered n events; raises if it ends first."""
    received = b""
    while received.count(b"data: ") < n:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError("the stream ended early")
        received += chunk


def cancel_after(server, body, delays):
    """A stream of `body` opened and closed after each delay (in seconds)."""
    for delay in delays:
        sock = open_stream(server, body)
        time.sleep(delay)
        sock.close()


def expect_serving(server, prompt):
    """A short greedy completion of `prompt` that must come back whole."""
    r = complete(server, {"prompt": prompt, "max_tokens": 4, "temperature": 0})
    if r["usage"]["completion_tokens"] != 4:
        raise AssertionError(f"{prompt!r}: {r}")


def write_key(path, text):
    """A cluster key file holding `text`, open to no one else (as the coordinator requires)."""
    with open(path, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def end_module(cluster, workdir):
    """A test module's tearDownModule: every rank exits 0 (unless a test stopped it), then
    the module's temporary folder goes."""
    try:
        if cluster is not None and cluster.process.poll() is None:
            stop_every_rank(cluster, timeout=60)
    finally:
        workdir.cleanup()


def start_sse(server, bodies):
    """One started SseStream per body (each streamed: "stream": true is added)."""
    streams = [SseStream("127.0.0.1", server.http_port, {**body, "stream": True})
               for body in bodies]
    for s in streams:
        s.start()
    return streams


def check_texts(test, streams, expected, timeout=180):
    """Each SseStream ended whole ("length") with expected[its prompt]."""
    for s in streams:
        s.join(timeout)
        test.assertFalse(s.is_alive(), f"a stream hung: {s.body['prompt']!r}")
        test.assertIsNone(s.failure, s.failure)
        test.assertIsNone(s.error)
        test.assertEqual(s.finish, "length")
        test.assertEqual(s.text, expected[s.body["prompt"]], s.body["prompt"])


class BackToBack:
    """`n` clients, each sending completions back to back (body(prompt), the
    prompts in turn) until stop(), every text checked against
    expected[prompt]; what failed or differed is in `failures`."""

    def __init__(self, server, prompts, body, expected, n):
        self.failures = []
        self._stop = threading.Event()
        self._clients = [threading.Thread(target=self._client, args=(server, prompts, body,
                                                                       expected, k))
                         for k in range(n)]
        for c in self._clients:
            c.start()

    def _client(self, server, prompts, body, expected, k):
        i = k
        while not self._stop.is_set():
            prompt = prompts[i % len(prompts)]
            i += 1
            try:
                text = complete(server, body(prompt))["choices"][0]["text"]
            except AssertionError as e:
                self.failures.append(str(e))
                continue
            if text != expected[prompt]:
                self.failures.append(f"{prompt[:40]!r}: {text!r} != {expected[prompt]!r}")

    def stop(self, timeout=300):
        self._stop.set()
        for c in self._clients:
            c.join(timeout)


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def run(command, timeout):
    """(exit code, combined output) of a command that must end within `timeout`."""
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=timeout)
    return result.returncode, result.stdout
