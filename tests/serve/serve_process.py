"""`duet serve` as a subprocess, for the serving tests.

The binary and the model come from the environment ctest sets: DUET_BINARY
and DUET_MODEL. A test whose model file is absent is skipped (with the reason
printed); a missing binary is a failure.

    with ServeProcess(["--api-key", "k"]) as server:
        server.http_url   # "http://127.0.0.1:PORT"
        server.rpc_port

The server binds port 0 for both fronts and prints `rpc listening on HOST:PORT`
and `http listening on HOST:PORT` on stdout; ServeProcess waits for both lines
and fails with the server's last log lines if it exits first. Leaving the
block (or stop()) sends SIGTERM and fails unless the server exits with code 0.
"""

import collections
import os
import re
import signal
import subprocess
import threading
import time
import unittest

_LISTENING = re.compile(r"^(rpc|http) listening on (\S+):(\d+)$")


def serve_environment():
    """(binary, model) from DUET_BINARY and DUET_MODEL; SkipTest without the model."""
    binary = os.environ.get("DUET_BINARY")
    model = os.environ.get("DUET_MODEL")
    if not binary or not os.path.exists(binary):
        raise RuntimeError(f"DUET_BINARY must name the duet binary (got {binary!r})")
    if not model or not os.path.exists(model):
        raise unittest.SkipTest(f"model file {model!r} is absent (DUET_MODEL)")
    return binary, model


class ServeProcess:
    """One `duet serve --model MODEL --http-port 0 --rpc-port 0 --threads 1 ARGS...`."""

    def __init__(self, args=(), startup_timeout=120.0, env=None):
        """`env`: variables added to this process's environment for the server."""
        binary, model = serve_environment()
        self.env = {**os.environ, **env} if env else None
        self.command = [binary, "serve", "--model", model, "--http-port", "0",
                        "--rpc-port", "0", "--threads", "1", *args]
        self.startup_timeout = startup_timeout
        self.process = None
        self._readers = []
        self.addresses = {}  # "rpc"/"http" -> (host, port)
        self._log = collections.deque(maxlen=200)  # the last lines of stderr
        self._ready = threading.Event()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, traceback):
        self.stop(check=exc_type is None)  # an exception in the block tells more
        return False

    @property
    def http_url(self):
        host, port = self.addresses["http"]
        return f"http://{host}:{port}"

    @property
    def http_port(self):
        return self.addresses["http"][1]

    @property
    def rpc_host(self):
        return self.addresses["rpc"][0]

    @property
    def rpc_port(self):
        return self.addresses["rpc"][1]

    def log_tail(self, n=30):
        return "\n".join(list(self._log)[-n:])

    def start(self):
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, errors="replace",
                                        env=self.env)
        # Both pipes are drained by threads, so a chatty server never blocks on them.
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                         threading.Thread(target=self._read_stderr, daemon=True)]
        for reader in self._readers:
            reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._ready.wait(0.05):
            if self.process.poll() is not None:
                self._close_pipes()
                raise RuntimeError(f"duet serve exited with code {self.process.returncode} before "
                                   f"listening:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop(check=False)
                raise RuntimeError(f"duet serve did not listen within {self.startup_timeout} s:\n"
                                   f"{self.log_tail()}")

    def stop(self, timeout=30.0, check=True):
        """SIGTERM, then waits; returns the exit code. Raises when it ignores
        SIGTERM for `timeout` (it is killed) or, with `check`, exits with
        another code than 0 (a crash, a sanitizer's report)."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                self._close_pipes()
                raise RuntimeError(f"duet serve ignored SIGTERM for {timeout} s:\n"
                                   f"{self.log_tail()}")
        self._close_pipes()
        if check and self.process.returncode != 0:
            raise RuntimeError(f"duet serve exited with code {self.process.returncode}:\n"
                               f"{self.log_tail()}")
        return self.process.returncode

    def _close_pipes(self):
        """After the process exited: lets the readers reach end-of-file, then closes."""
        for reader in self._readers:
            reader.join(5)
        for pipe in (self.process.stdout, self.process.stderr):
            if not pipe.closed:
                pipe.close()

    def _read_stdout(self):
        for line in self.process.stdout:
            match = _LISTENING.match(line.strip())
            if match:
                host = match.group(2)
                if host in ("0.0.0.0", "::", "[::]"):
                    host = "127.0.0.1"
                self.addresses[match.group(1)] = (host, int(match.group(3)))
                if {"rpc", "http"} <= self.addresses.keys():
                    self._ready.set()
            else:
                self._log.append(line.rstrip("\n"))

    def _read_stderr(self):
        for line in self.process.stderr:
            self._log.append(line.rstrip("\n"))


def start_shared(args=()):
    """The server a whole test module shares, started (for its setUpModule)."""
    server = ServeProcess(args)
    server.start()
    return server


def stop_shared(server):
    """For tearDownModule: stops the shared server if it was made; raises
    unless it exits with code 0."""
    if server is not None:
        server.stop()


def http_request(url, method="GET", body=None, headers=None, timeout=60.0):
    """One HTTP request on a new connection: (status, headers dict, body bytes).

    `body` may be bytes, str or a JSON-able value (sent as JSON). Error statuses
    are returned, not raised.
    """
    import http.client
    import json
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    if body is not None and not isinstance(body, (bytes, str)):
        body = json.dumps(body)
    if isinstance(body, str):
        body = body.encode()
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        connection.request(method, path or "/", body=body,
                           headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def parse_metrics(text):
    """Prometheus text exposition -> {"name{labels}": value} (samples only)."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
