"""Stopping `duet serve` (SIGTERM) while HTTP requests generate: it drains.

- The requests in flight finish normally (a stream with finish_reason
  `length` and [DONE], a whole request with every token) while a new request
  gets 503, /health and /health/ready answer 503 ("draining") and
  /health/live 200; then the process exits 0.
- With --drain-timeout 1, what still runs at the timeout ends with an
  `unavailable` error (a stream's error event then [DONE], a whole request's
  503), and the process exits 0.
- A second SIGTERM cuts a long drain short the same way.

Run by ctest (tests/serve/http_tests.cmake) with DUET_BINARY and DUET_MODEL set.
"""

import json
import os
import signal
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, http_request, parse_metrics  # noqa: E402

LONG = {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}


def open_request(port, body):
    """A raw socket that has sent one POST /v1/completions."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_all(sock):
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def last_event(received):
    """The JSON of a stream's last event before [DONE]."""
    return json.loads(received.rsplit(b"data: ", 2)[1].split(b"\n\n")[0])


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


class ShutdownTest(unittest.TestCase):
    def start_two(self, server, body):
        """A stream and a whole request of `body`, both generating; the stream's bytes so far."""
        stream = open_request(server.http_port, {**body, "stream": True})
        whole = open_request(server.http_port, body)
        received = b""
        while received.count(b"data: ") < 3:
            chunk = stream.recv(4096)
            self.assertTrue(chunk, "the stream ended early")
            received += chunk
        wait_until(lambda: parse_metrics(http_request(server.http_url + "/metrics")[2].decode())[
            "duet_running_sequences"] == 2, 10, "the requests to both start")
        return stream, whole, received

    def signal_and_wait_draining(self, server):
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: http_request(server.http_url + "/health/ready")[0] == 503, 10,
                   "/health/ready to say 503")

    def wait_exit(self, server, timeout=30):
        try:
            server.process.wait(timeout)
        finally:
            code = server.stop(check=False)
        self.assertEqual(code, 0, server.log_tail())

    def expect_cut(self, stream, received, whole):
        received += read_all(stream)
        stream.close()
        # The chunked stream ends with an error event, [DONE] and the last chunk.
        self.assertTrue(received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-300:])
        error = last_event(received)["error"]
        self.assertEqual((error["code"], error["message"]),
                         ("unavailable", "the server is shutting down"))
        reply = read_all(whole)
        whole.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 503 "), reply[:300])
        self.assertIn(b"Retry-After: ", reply)
        self.assertEqual(json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"],
                         "unavailable")

    def test_sigterm_lets_requests_in_flight_finish(self):
        server = ServeProcess()
        server.start()
        body = {**LONG, "max_tokens": 300}
        try:
            stream, whole, received = self.start_two(server, body)
            self.signal_and_wait_draining(server)
            status, headers, reply = http_request(server.http_url + "/v1/completions", "POST",
                                                  {"prompt": "Hello", "max_tokens": 4})
            self.assertEqual(status, 503, reply[:300])
            self.assertEqual(json.loads(reply)["error"]["code"], "unavailable")
            self.assertIn("retry-after", headers)
            for path, want in (("/health", 503), ("/health/ready", 503), ("/health/live", 200)):
                status, _, reply = http_request(server.http_url + path)
                self.assertEqual((path, status, json.loads(reply)["status"]),
                                 (path, want, "draining"))
            self.assertEqual(parse_metrics(http_request(server.http_url + "/metrics")[2].decode())[
                "duet_draining"], 1)
        finally:
            self.wait_exit(server)

        received += read_all(stream)
        stream.close()
        self.assertTrue(received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-300:])
        self.assertNotIn(b'"error"', received)
        self.assertEqual(last_event(received)["choices"][0]["finish_reason"], "length")
        reply = read_all(whole)
        whole.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:300])
        answer = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        self.assertEqual(answer["choices"][0]["finish_reason"], "length")
        self.assertEqual(answer["usage"]["completion_tokens"], 300)

    def test_drain_timeout_ends_what_still_runs_unavailable(self):
        server = ServeProcess(["--drain-timeout", "1"])
        server.start()
        try:
            stream, whole, received = self.start_two(server, LONG)
            server.process.send_signal(signal.SIGTERM)
        finally:
            self.wait_exit(server)
        self.expect_cut(stream, received, whole)

    def test_a_second_sigterm_cuts_the_drain_short(self):
        server = ServeProcess(["--drain-timeout", "600"])
        server.start()
        try:
            stream, whole, received = self.start_two(server, LONG)
            self.signal_and_wait_draining(server)
            server.process.send_signal(signal.SIGTERM)
        finally:
            self.wait_exit(server, timeout=15)
        self.expect_cut(stream, received, whole)


if __name__ == "__main__":
    unittest.main(verbosity=2)
