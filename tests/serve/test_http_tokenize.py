"""The HTTP front's llama-server-compatible POST /tokenize and /detokenize:
exact token counts for clients such as duet-bench, the same tokenizer the
completions routes use, OpenAI-style 400s for bad input, and the API key rule.

Run by ctest (tests/serve/http_tests.cmake) with DUET_BINARY and DUET_MODEL set.
"""

import json
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, http_request  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog. Café, 1234!"


def post(server, path, body, headers=None):
    status, _, raw = http_request(server.http_url + path, "POST", body, headers)
    return status, json.loads(raw)


class HttpTokenizeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServeProcess()
        cls.server.start()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def tokenize(self, text, **extra):
        status, body = post(self.server, "/tokenize", {"content": text, **extra})
        self.assertEqual(status, 200, body)
        self.assertEqual(list(body), ["tokens"])
        self.assertTrue(all(isinstance(t, int) for t in body["tokens"]))
        return body["tokens"]

    def test_round_trip(self):
        tokens = self.tokenize(TEXT)
        self.assertGreater(len(tokens), 10)
        status, body = post(self.server, "/detokenize", {"tokens": tokens})
        self.assertEqual(status, 200, body)
        self.assertEqual(body, {"content": TEXT})

    def test_empty(self):
        self.assertEqual(self.tokenize(""), [])
        self.assertEqual(post(self.server, "/detokenize", {"tokens": []}), (200, {"content": ""}))

    def test_add_special_defaults_to_false(self):
        self.assertEqual(self.tokenize(TEXT), self.tokenize(TEXT, add_special=False))
        with_special = self.tokenize(TEXT, add_special=True)
        self.assertTrue(with_special[-len(self.tokenize(TEXT)):] == self.tokenize(TEXT))

    def test_special_tokens_are_parsed(self):
        self.assertEqual(len(self.tokenize("<|im_start|>")), 1)

    def test_counts_match_the_completions_route(self):
        """A prompt's token count is what /v1/completions reports, and its ids
        as the prompt generate what its text does."""
        tokens = self.tokenize(TEXT)
        answers = []
        for prompt in (TEXT, tokens):
            status, _, raw = http_request(self.server.http_url + "/v1/completions", "POST",
                                          {"prompt": prompt, "max_tokens": 4, "temperature": 0})
            self.assertEqual(status, 200, raw)
            body = json.loads(raw)
            self.assertEqual(body["usage"]["prompt_tokens"], len(tokens))
            answers.append(body["choices"][0]["text"])
        self.assertEqual(answers[0], answers[1])

    def test_partial_utf8_is_replaced(self):
        tokens = self.tokenize("é" * 3 + "日本")
        for n in range(1, len(tokens) + 1):
            status, body = post(self.server, "/detokenize", {"tokens": tokens[:n]})
            self.assertEqual(status, 200, body)
            self.assertIsInstance(body["content"], str)

    def test_bad_requests(self):
        cases = [
            ("/tokenize", b'{"content": ', "invalid_json", None),
            ("/tokenize", b'\xff\xfe', "invalid_utf8", None),
            ("/tokenize", [1, 2], "invalid_type", "body"),
            ("/tokenize", {}, "missing_field", "content"),
            ("/tokenize", {"content": 5}, "invalid_type", "content"),
            ("/tokenize", {"content": "x", "add_special": "yes"}, "invalid_type", "add_special"),
            ("/detokenize", {}, "missing_field", "tokens"),
            ("/detokenize", {"tokens": "1 2"}, "invalid_type", "tokens"),
            ("/detokenize", {"tokens": [1, "2"]}, "invalid_type", "tokens"),
            ("/detokenize", {"tokens": [1.5]}, "invalid_type", "tokens"),
            ("/detokenize", {"tokens": [-1]}, "invalid_value", "tokens"),
            ("/detokenize", {"tokens": [2**40]}, "invalid_value", "tokens"),
            ("/detokenize", {"tokens": [10**7]}, "invalid_argument", None),
        ]
        for path, body, code, param in cases:
            with self.subTest(path=path, body=body):
                status, reply = post(self.server, path, body)
                self.assertEqual(status, 400, reply)
                self.assertEqual(reply["error"]["code"], code)
                self.assertEqual(reply["error"]["param"], param)
                self.assertTrue(reply["error"]["message"])
        # The server kept serving.
        self.assertTrue(self.tokenize("still here"))

    def test_only_post(self):
        for path in ("/tokenize", "/detokenize"):
            status, headers, _ = http_request(self.server.http_url + path)
            self.assertEqual(status, 405)
            self.assertEqual(headers["allow"], "POST")


class HttpTokenizeApiKeyTest(unittest.TestCase):
    KEY = "tokenize-key"

    def test_api_key_is_required(self):
        with ServeProcess(["--api-key", self.KEY]) as server:
            status, body = post(server, "/tokenize", {"content": "x"})
            self.assertEqual(status, 401, body)
            self.assertEqual(body["error"]["code"], "invalid_api_key")
            status, body = post(server, "/detokenize", {"tokens": [1]})
            self.assertEqual(status, 401, body)
            status, body = post(server, "/tokenize", {"content": "x"},
                                {"Authorization": f"Bearer {self.KEY}"})
            self.assertEqual(status, 200, body)


if __name__ == "__main__":
    unittest.main(verbosity=2)
