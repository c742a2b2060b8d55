"""Stopping `duet serve` (SIGTERM) while HTTP requests generate: each client
gets a final answer (a stream's error event, a whole request's 503) and the
process exits cleanly.

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


class ShutdownTest(unittest.TestCase):
    def test_sigterm_answers_requests_in_flight(self):
        server = ServeProcess()
        server.start()
        try:
            stream = open_request(server.http_port, {**LONG, "stream": True})
            whole = open_request(server.http_port, LONG)
            received = b""
            while received.count(b"data: ") < 3:
                chunk = stream.recv(4096)
                self.assertTrue(chunk, "the stream ended early")
                received += chunk
            deadline = time.monotonic() + 10
            while parse_metrics(http_request(server.http_url + "/metrics")[2].decode())[
                    "duet_running_sequences"] < 2:
                self.assertLess(time.monotonic(), deadline, "the requests did not both start")
                time.sleep(0.02)
        finally:
            code = server.stop(check=False)
        self.assertEqual(code, 0, server.log_tail())

        received += read_all(stream)
        stream.close()
        # The chunked stream ends with an error event, [DONE] and the last chunk.
        self.assertTrue(received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), received[-300:])
        last_event = received.rsplit(b"data: ", 2)[1].split(b"\n\n")[0]
        self.assertEqual(json.loads(last_event)["error"]["code"], "unavailable")

        reply = read_all(whole)
        whole.close()
        self.assertTrue(reply.startswith(b"HTTP/1.1 503 "), reply[:300])
        self.assertIn(b"Retry-After: ", reply)
        self.assertEqual(json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"],
                         "unavailable")


if __name__ == "__main__":
    unittest.main(verbosity=2)
