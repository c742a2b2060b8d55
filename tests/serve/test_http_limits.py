"""The HTTP front's limits: the API key is checked from the header fields
before the body is read, connections past --max-connections get a 503
(overloaded) and are counted, and a connection idle past --http-idle-timeout
is closed while a slow stream is not.

Run by ctest (tests/serve/http_tests.cmake) with DUET_BINARY and DUET_MODEL set.
"""

import json
import os
import socket
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, http_request, parse_metrics  # noqa: E402

KEY = "sk-duet-limits"


def read_response(sock, timeout):
    """Reads one response (status line, headers, body by Content-Length) or
    whatever arrives until the peer closes; returns (status, headers, body)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def closed_by_peer(sock, timeout):
    """Whether the peer closes `sock` (end-of-file or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


class KeyBeforeBodyTest(unittest.TestCase):
    def test_wrong_key_is_refused_without_reading_the_body(self):
        with ServeProcess(["--api-key", KEY]) as server:
            with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
                # A 1 MB body announced and never sent: the 401 must not wait for it.
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer wrong\r\n"
                             b"Content-Type: application/json\r\n"
                             b"Content-Length: 1000000\r\n\r\n")
                started = time.monotonic()
                status, headers, body = read_response(sock, timeout=10)
                elapsed = time.monotonic() - started
            self.assertEqual(status, 401, body)
            self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
            self.assertEqual(headers.get("connection"), "close")
            self.assertLess(elapsed, 2.0)
            # The right key still works, and the refusal was counted.
            status, _, raw = http_request(server.http_url + "/v1/completions", "POST",
                                          {"prompt": "Hi", "max_tokens": 1},
                                          {"Authorization": f"Bearer {KEY}"})
            self.assertEqual(status, 200, raw)
            _, _, raw = http_request(server.http_url + "/metrics",
                                     headers={"Authorization": f"Bearer {KEY}"})
            samples = parse_metrics(raw.decode())
            self.assertGreaterEqual(
                samples['duet_requests_total{outcome="refused_unauthenticated"}'], 1)


class MaxConnectionsTest(unittest.TestCase):
    def test_connections_past_the_cap_get_503_and_are_counted(self):
        with ServeProcess(["--max-connections", "2"]) as server:
            address = ("127.0.0.1", server.http_port)
            held = [socket.create_connection(address) for _ in range(2)]
            try:
                time.sleep(0.2)  # both accepted
                with socket.create_connection(address) as extra:
                    extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                    status, headers, body = read_response(extra, timeout=10)
                self.assertEqual(status, 503, body)
                error = json.loads(body)["error"]
                self.assertEqual(error["type"], "overloaded")
                self.assertEqual(error["code"], "too_many_connections")
                self.assertEqual(headers.get("retry-after"), "1")
                self.assertEqual(headers.get("connection"), "close")
                # A held connection is served.
                held[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                status, _, raw = read_response(held[0], timeout=10)
                self.assertEqual(status, 200)
                samples = parse_metrics(raw.decode())
                self.assertEqual(samples['duet_connections_refused_total{front="http"}'], 1)
            finally:
                for sock in held:
                    sock.close()
            time.sleep(0.2)  # the server sees them close
            status, _, _ = http_request(server.http_url + "/v1/models")
            self.assertEqual(status, 200)


class IdleTimeoutTest(unittest.TestCase):
    def test_idle_connection_closes_and_a_slow_stream_does_not(self):
        with ServeProcess(["--http-idle-timeout", "0.5", "--max-running", "1"]) as server:
            address = ("127.0.0.1", server.http_port)
            with socket.create_connection(address) as idle:
                self.assertTrue(closed_by_peer(idle, timeout=5))
            # After a response, the kept-alive connection idles out too.
            with socket.create_connection(address) as kept:
                kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                status, _, _ = read_response(kept, timeout=10)
                self.assertEqual(status, 200)
                started = time.monotonic()
                self.assertTrue(closed_by_peer(kept, timeout=5))
                self.assertGreater(time.monotonic() - started, 0.3)
            # A stream that outlasts the timeout, queued behind another one
            # (one runs at a time), is not cut. Long enough to outlast it on a
            # fast core too (80 tokens took 0.44 s on Zen 5).
            body = {"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            streams = []
            for _ in range(2):
                sock = socket.create_connection(address)
                payload = json.dumps(body).encode()
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Type: application/json\r\n"
                             + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                streams.append(sock)
            started = time.monotonic()
            for sock in streams:
                sock.settimeout(60)
                data = b""
                while b"data: [DONE]" not in data:
                    chunk = sock.recv(65536)
                    self.assertTrue(chunk, "the stream was cut")
                    data += chunk
                self.assertIn(b'"finish_reason":"length"', data)
                sock.close()
            self.assertGreater(time.monotonic() - started, 0.5, "not a test of the timeout")


if __name__ == "__main__":
    unittest.main(verbosity=2)
