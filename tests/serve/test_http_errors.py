"""The HTTP front's refusals: every bad input gets its own status and an
OpenAI-style error object, and the server keeps serving; API keys; overload.

Run by ctest (tests/serve/http_tests.cmake) with DUET_BINARY and DUET_MODEL set.
"""

import concurrent.futures
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, http_request  # noqa: E402

import openai  # noqa: E402

MAX_BODY_BYTES = 65536
GOOD = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

# (name, method, path, body, status, code, param); a body of bytes is sent as is.
BAD_REQUESTS = [
    ("malformed JSON", "POST", "/v1/completions", b'{"prompt": "x",', 400, "invalid_json", None),
    ("empty body", "POST", "/v1/completions", b"", 400, "invalid_json", None),
    ("body not an object", "POST", "/v1/completions", [1, 2], 400, "invalid_type", "body"),
    ("invalid UTF-8", "POST", "/v1/completions", b'{"prompt": "caf\xc3\x28\xff"}', 400,
     "invalid_utf8", None),
    ("unpaired surrogate escape", "POST", "/v1/completions", b'{"prompt": "\\ud800"}', 400,
     "invalid_json", None),
    ("max_tokens a string", "POST", "/v1/completions", {**GOOD, "max_tokens": "ten"}, 400,
     "invalid_type", "max_tokens"),
    ("max_tokens fractional", "POST", "/v1/completions", {**GOOD, "max_tokens": 1.5}, 400,
     "invalid_type", "max_tokens"),
    ("max_tokens negative", "POST", "/v1/completions", {**GOOD, "max_tokens": -1}, 400,
     "invalid_value", "max_tokens"),
    ("max_tokens zero", "POST", "/v1/completions", {**GOOD, "max_tokens": 0}, 400,
     "invalid_argument", None),
    ("max_tokens huge", "POST", "/v1/completions", {**GOOD, "max_tokens": 10**9}, 400,
     "context_length_exceeded", None),
    ("max_tokens beyond 64 bits", "POST", "/v1/completions", {**GOOD, "max_tokens": 2**70}, 400,
     "context_length_exceeded", None),
    ("max_completion_tokens a string", "POST", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": "x"}, 400, "invalid_type", "max_completion_tokens"),
    ("temperature a string", "POST", "/v1/completions", {**GOOD, "temperature": "hot"}, 400,
     "invalid_type", "temperature"),
    ("temperature negative", "POST", "/v1/completions", {**GOOD, "temperature": -1}, 400,
     "invalid_value", "temperature"),
    ("top_p over 1", "POST", "/v1/completions", {**GOOD, "top_p": 5}, 400, "invalid_value",
     "top_p"),
    ("top_k below -1", "POST", "/v1/completions", {**GOOD, "top_k": -2}, 400, "invalid_value",
     "top_k"),
    ("seed a string", "POST", "/v1/completions", {**GOOD, "seed": "x"}, 400, "invalid_type",
     "seed"),
    ("stream a string", "POST", "/v1/completions", {**GOOD, "stream": "yes"}, 400,
     "invalid_type", "stream"),
    ("stream_options a string", "POST", "/v1/completions",
     {**GOOD, "stream": True, "stream_options": "x"}, 400, "invalid_type", "stream_options"),
    ("ignore_eos a string", "POST", "/v1/completions", {**GOOD, "ignore_eos": "no"}, 400,
     "invalid_type", "ignore_eos"),
    ("return_token_ids a string", "POST", "/v1/completions", {**GOOD, "return_token_ids": "yes"},
     400, "invalid_type", "return_token_ids"),
    ("chat return_token_ids a number", "POST", "/v1/chat/completions",
     {**CHAT, "return_token_ids": 1}, 400, "invalid_type", "return_token_ids"),
    ("stop a number", "POST", "/v1/completions", {**GOOD, "stop": 5}, 400, "invalid_type",
     "stop"),
    ("stop empty", "POST", "/v1/completions", {**GOOD, "stop": [""]}, 400, "invalid_value",
     "stop"),
    ("n of 2", "POST", "/v1/completions", {**GOOD, "n": 2}, 400, "unsupported_value", "n"),
    ("logprobs", "POST", "/v1/completions", {**GOOD, "logprobs": 3}, 400, "unsupported_value",
     "logprobs"),
    ("prompt missing", "POST", "/v1/completions", {"max_tokens": 2}, 400, "missing_field",
     "prompt"),
    ("prompt a number", "POST", "/v1/completions", {**GOOD, "prompt": 42}, 400, "invalid_type",
     "prompt"),
    ("several prompts", "POST", "/v1/completions", {**GOOD, "prompt": ["a", "b"]}, 400,
     "unsupported_value", "prompt"),
    ("negative token id", "POST", "/v1/completions", {**GOOD, "prompt": [1, -5]}, 400,
     "invalid_value", "prompt"),
    ("token id outside the vocabulary", "POST", "/v1/completions",
     {**GOOD, "prompt": [10**7]}, 400, "invalid_argument", None),
    ("prompt too long", "POST", "/v1/completions", {**GOOD, "prompt": "hello " * 9000}, 400,
     "context_length_exceeded", None),
    ("messages missing", "POST", "/v1/chat/completions", {"max_tokens": 2}, 400,
     "missing_field", "messages"),
    ("messages not an array", "POST", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400,
     "invalid_type", "messages"),
    ("messages empty", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, 400,
     "invalid_value", "messages"),
    ("message not an object", "POST", "/v1/chat/completions", {**CHAT, "messages": ["hi"]}, 400,
     "invalid_type", "messages[0]"),
    ("content not a string", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_type",
     "messages[0].content"),
    ("unknown role", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value",
     "messages[0].role"),
    ("unknown model", "POST", "/v1/completions", {**GOOD, "model": "gpt-4"}, 404,
     "model_not_found", "model"),
    ("unknown chat model", "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404,
     "model_not_found", "model"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "not_found", None),
    ("unknown model id", "GET", "/v1/models/gpt-4", None, 404, "model_not_found", None),
    ("GET a POST route", "GET", "/v1/completions", None, 405, "method_not_allowed", None),
    ("POST a GET route", "POST", "/v1/models", GOOD, 405, "method_not_allowed", None),
]


class BadInputTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServeProcess(["--max-body-bytes", str(MAX_BODY_BYTES)])
        cls.server.start()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def assert_error(self, status, headers, body, expected_status, code=None, param=None):
        self.assertEqual(status, expected_status, body)
        self.assertEqual(headers.get("content-type"), "application/json")
        error = json.loads(body)["error"]
        self.assertTrue(error["message"])
        self.assertTrue(error["type"])
        if code is not None:
            self.assertEqual(error["code"], code, error)
        if param is not None:
            self.assertEqual(error["param"], param, error)
        return error

    def test_each_bad_request_then_a_good_one_on_the_same_connection(self):
        connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        try:
            for name, method, path, body, status, code, param in BAD_REQUESTS:
                with self.subTest(name):
                    if body is not None and not isinstance(body, bytes):
                        body = json.dumps(body).encode()
                    connection.request(method, path, body=body,
                                       headers={"Content-Type": "application/json"})
                    response = connection.getresponse()
                    headers = {k.lower(): v for k, v in response.getheaders()}
                    self.assert_error(response.status, headers, response.read(), status, code,
                                      param)
                    if status == 405:
                        self.assertIn(headers["allow"], ("GET", "POST"))
            connection.request("POST", "/v1/completions", body=json.dumps(GOOD))
            response = connection.getresponse()
            self.assertEqual(response.status, 200)
            self.assertEqual(json.loads(response.read())["usage"]["completion_tokens"], 2)
        finally:
            connection.close()

    def test_body_over_the_limit(self):
        body = {**GOOD, "prompt": "x" * (MAX_BODY_BYTES + 10)}
        status, headers, raw = http_request(self.server.http_url + "/v1/completions", "POST",
                                            body)
        self.assert_error(status, headers, raw, 413, "request_too_large")
        self.assertEqual(headers.get("connection"), "close")
        status, _, _ = http_request(self.server.http_url + "/v1/completions", "POST", GOOD)
        self.assertEqual(status, 200)

    def test_body_over_the_limit_with_curl(self):
        # curl asks "Expect: 100-continue" first and never sends the refused body.
        body = json.dumps({**GOOD, "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
        result = subprocess.run(
            ["curl", "-sS", "--max-time", "30", "-H", "Expect: 100-continue", "-w",
             "\n%{http_code}", "--data-binary", "@-", self.server.http_url + "/v1/completions"],
            input=body, capture_output=True, check=True)
        reply, _, status = result.stdout.decode().rpartition("\n")
        self.assertEqual(status, "413")
        self.assertEqual(json.loads(reply)["error"]["code"], "request_too_large")

    def test_malformed_http(self):
        with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30) as sock:
            sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
        self.assertTrue(reply.startswith(b"HTTP/1.1 400 "), reply)
        status, _, _ = http_request(self.server.http_url + "/health")
        self.assertEqual(status, 200)

    def test_openai_client_sees_typed_errors(self):
        client = openai.OpenAI(base_url=self.server.http_url + "/v1", api_key="unused",
                               max_retries=0)
        with self.assertRaises(openai.BadRequestError) as caught:
            client.completions.create(model="", prompt="Hello", max_tokens=2, n=2)
        self.assertEqual(caught.exception.code, "unsupported_value")
        with self.assertRaises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4", messages=CHAT["messages"])


class ApiKeyTest(unittest.TestCase):
    KEY = "sk-duet-test"

    @classmethod
    def setUpClass(cls):
        cls.server = ServeProcess(["--api-key", cls.KEY])
        cls.server.start()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def test_bearer_key_required(self):
        url = self.server.http_url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": self.KEY},
                        {"Authorization": f"Bearer {self.KEY}x"}):
            for method, path, body in (("POST", "/v1/completions", GOOD),
                                       ("GET", "/v1/models", None), ("GET", "/metrics", None)):
                with self.subTest(headers=headers, path=path):
                    status, reply_headers, raw = http_request(url + path, method, body, headers)
                    self.assertEqual(status, 401)
                    error = json.loads(raw)["error"]
                    self.assertEqual(error["code"], "invalid_api_key")
        status, _, _ = http_request(url + "/health")
        self.assertEqual(status, 200)  # probes need no key
        status, _, raw = http_request(url + "/v1/completions", "POST", GOOD,
                                      {"Authorization": f"Bearer {self.KEY}"})
        self.assertEqual(status, 200, raw)

    def test_openai_client(self):
        url = self.server.http_url + "/v1"
        with self.assertRaises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url, api_key=self.KEY, max_retries=0)
        response = client.chat.completions.create(model=client.models.list().data[0].id,
                                                  messages=CHAT["messages"], max_tokens=2)
        self.assertEqual(response.usage.completion_tokens, 2)


class ApiKeyOffTheCommandLineTest(unittest.TestCase):
    """--api-key-file and DUET_API_KEY: the key works and `ps` does not show it."""
    KEY = "sk-duet-off-the-command-line"

    def expect_key_required(self, server):
        status, _, _ = http_request(server.http_url + "/v1/models")
        self.assertEqual(status, 401)
        status, _, raw = http_request(server.http_url + "/v1/models",
                                      headers={"Authorization": f"Bearer {self.KEY}"})
        self.assertEqual(status, 200, raw)
        with open(f"/proc/{server.process.pid}/cmdline", "rb") as f:
            self.assertNotIn(self.KEY.encode(), f.read())

    def test_key_file(self):
        with tempfile.NamedTemporaryFile("w", suffix=".key") as key_file:
            key_file.write(self.KEY + "\n")
            key_file.flush()
            with ServeProcess(["--api-key-file", key_file.name]) as server:
                self.expect_key_required(server)

    def test_environment(self):
        with ServeProcess(env={"DUET_API_KEY": self.KEY}) as server:
            self.expect_key_required(server)


class OverloadTest(unittest.TestCase):
    def test_full_queue_is_429_with_retry_after(self):
        # One sequence runs at a time and one request may wait: of several sent
        # at once while the first generates, some must be refused.
        with ServeProcess(["--max-waiting", "1", "--max-running", "1"]) as server:
            body = {"prompt": "Hello", "max_tokens": 256, "ignore_eos": True, "temperature": 0}
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(
                    lambda _: http_request(server.http_url + "/v1/completions", "POST", body),
                    range(4)))
            statuses = sorted(status for status, _, _ in replies)
            self.assertEqual(statuses[0], 200)
            self.assertEqual(statuses[-1], 429)
            for status, headers, raw in replies:
                if status == 429:
                    self.assertEqual(headers.get("retry-after"), "1")
                    self.assertEqual(json.loads(raw)["error"]["code"], "overloaded")


if __name__ == "__main__":
    unittest.main(verbosity=2)
