"""The OpenAI-compatible HTTP front, end to end: the real `duet serve` answering
the official `openai` package, curl and raw sockets.

Run by ctest (tests/serve/http_tests.cmake) with DUET_BINARY and DUET_MODEL set.
"""

import json
import os
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_process import ServeProcess, http_request, parse_metrics  # noqa: E402

import openai  # noqa: E402

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def sse_events(raw):
    """The JSON payloads of `data: ...` events, and whether [DONE] ended them."""
    events, done = [], False
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


class HttpOpenAiTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = ServeProcess()
        cls.server.start()
        cls.client = openai.OpenAI(base_url=cls.server.http_url + "/v1", api_key="unused",
                                   max_retries=0, timeout=60)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def metrics(self):
        status, headers, body = http_request(self.server.http_url + "/metrics")
        self.assertEqual(status, 200)
        return parse_metrics(body.decode())

    def wait_until_idle(self, timeout=10.0):
        """Polls /metrics until no request runs and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["duet_active_requests"] == 0 and m["duet_running_sequences"] == 0
                    and m["duet_kv_blocks_free"] == m["duet_kv_blocks_total"]):
                return m
            if time.monotonic() > deadline:
                self.fail(f"the server is still busy after {timeout} s: {m}")
            time.sleep(0.05)

    # --- the official client ---------------------------------------------------------------

    def test_completion_stream_matches_whole(self):
        whole = self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=16,
                                               temperature=0)
        self.assertTrue(whole.id.startswith("cmpl-"))
        self.assertEqual(whole.object, "text_completion")
        self.assertEqual(whole.model, self.model)
        self.assertEqual(len(whole.choices), 1)
        choice = whole.choices[0]
        self.assertEqual(choice.index, 0)
        self.assertIn(choice.finish_reason, ("stop", "length"))
        self.assertTrue(choice.text)
        usage = whole.usage
        self.assertGreater(usage.prompt_tokens, 0)
        self.assertLessEqual(usage.completion_tokens, 16)
        self.assertEqual(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens)
        duet = whole.model_extra["duet"]
        for key in ("queue_ms", "ttft_ms", "tpot_ms", "e2e_ms", "cached_tokens"):
            self.assertGreaterEqual(duet[key], 0, key)
        self.assertGreaterEqual(duet["e2e_ms"], duet["ttft_ms"])

        chunks = list(self.client.completions.create(model=self.model, prompt=PROMPT,
                                                     max_tokens=16, temperature=0, stream=True))
        self.assertEqual("".join(c.choices[0].text for c in chunks), choice.text)
        self.assertTrue(all(c.id == chunks[0].id and c.object == "text_completion"
                            for c in chunks))
        self.assertTrue(all(c.choices[0].finish_reason is None for c in chunks[:-1]))
        self.assertEqual(chunks[-1].choices[0].finish_reason, choice.finish_reason)
        self.assertIn("ttft_ms", chunks[-1].model_extra["duet"])

    def test_chat_stream_matches_whole(self):
        whole = self.client.chat.completions.create(model=self.model, messages=CHAT,
                                                    max_tokens=16, temperature=0)
        self.assertTrue(whole.id.startswith("chatcmpl-"))
        self.assertEqual(whole.object, "chat.completion")
        message = whole.choices[0].message
        self.assertEqual(message.role, "assistant")
        self.assertTrue(message.content)
        self.assertIn(whole.choices[0].finish_reason, ("stop", "length"))

        chunks = list(self.client.chat.completions.create(
            model=self.model, messages=CHAT, max_completion_tokens=16, temperature=0,
            stream=True))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        self.assertTrue(all(c.object == "chat.completion.chunk" for c in chunks))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        self.assertEqual(text, message.content)
        self.assertEqual(chunks[-1].choices[0].finish_reason, whole.choices[0].finish_reason)

    def test_thinking_template_splits_reasoning(self):
        """A template that thinks turns the <think> split on (the unit tests,
        reasoning_test, hold the rule); a reply without a <think> block comes
        back whole in `content`, as the plain server's."""
        whole = self.client.chat.completions.create(model=self.model, messages=CHAT,
                                                    max_tokens=12, temperature=0)
        template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                    "{% endfor %}<|im_start|>assistant\n<think>\n\n</think>\n\n")
        def serving_line(server):
            # Logged just after the ports are printed: wait for it.
            deadline = time.monotonic() + 10
            while "serving " not in server.log_tail(50) and time.monotonic() < deadline:
                time.sleep(0.05)
            return next(line for line in server.log_tail(50).splitlines() if "serving " in line)

        with ServeProcess(["--chat-template", template]) as thinking:
            self.assertIn("<think> blocks as reasoning_content", serving_line(thinking))
            client = openai.OpenAI(base_url=thinking.http_url + "/v1", api_key="unused",
                                   max_retries=0, timeout=60)
            reply = client.chat.completions.create(model=self.model, messages=CHAT,
                                                   max_tokens=12, temperature=0)
            message = reply.choices[0].message
            self.assertEqual(message.content, whole.choices[0].message.content)
            self.assertIsNone(getattr(message, "reasoning_content", None))
        with ServeProcess(["--chat-template", template, "--reasoning-format", "none"]) as plain:
            self.assertNotIn("reasoning_content", serving_line(plain))

    def test_stop_strings(self):
        text = self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=16,
                                              temperature=0).choices[0].text
        words = text.split()
        self.assertGreaterEqual(len(words), 3, text)
        stop = words[2]
        expected = text[:text.index(stop)]
        for stream in (False, True):
            for stops in (stop, ["no such string", stop]):
                with self.subTest(stream=stream, stops=stops):
                    response = self.client.completions.create(
                        model=self.model, prompt=PROMPT, max_tokens=16, temperature=0,
                        stop=stops, stream=stream)
                    chunks = list(response) if stream else [response]
                    self.assertEqual("".join(c.choices[0].text for c in chunks), expected)
                    self.assertEqual(chunks[-1].choices[0].finish_reason, "stop")

    def test_stream_include_usage(self):
        whole = self.client.chat.completions.create(model=self.model, messages=CHAT,
                                                    max_tokens=8, temperature=0)
        chunks = list(self.client.chat.completions.create(
            model=self.model, messages=CHAT, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        last = chunks[-1]
        self.assertEqual(last.choices, [])
        self.assertEqual(last.usage.prompt_tokens, whole.usage.prompt_tokens)
        self.assertEqual(last.usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(last.usage.total_tokens, whole.usage.total_tokens)
        self.assertTrue(all(c.usage is None for c in chunks[:-1]))

    def test_seed_reproduces_sampling(self):
        def sample(seed):
            return self.client.completions.create(
                model=self.model, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.95,
                seed=seed, extra_body={"top_k": 40}).choices[0].text
        self.assertEqual(sample(7), sample(7))

    def test_prompt_forms(self):
        text = self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=8,
                                              temperature=0).choices[0].text
        one_item = self.client.completions.create(model=self.model, prompt=[PROMPT],
                                                  max_tokens=8, temperature=0)
        self.assertEqual(one_item.choices[0].text, text)
        ids = self.client.completions.create(model=self.model, prompt=[504, 3575, 282, 4649],
                                             max_tokens=4, temperature=0)
        self.assertEqual(ids.usage.prompt_tokens, 4)
        self.assertEqual(ids.usage.completion_tokens, 4)

    def test_extra_sampling_fields(self):
        response = self.client.completions.create(
            model=self.model, prompt=PROMPT, max_tokens=8, temperature=0.7,
            extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                        "ignore_eos": True},
            frequency_penalty=0.2, presence_penalty=0.1, seed=3)
        self.assertEqual(response.usage.completion_tokens, 8)
        self.assertEqual(response.choices[0].finish_reason, "length")

    # --- token ids -------------------------------------------------------------------------

    def detokenize(self, ids):
        status, _, body = http_request(self.server.http_url + "/detokenize", "POST",
                                       {"tokens": ids})
        self.assertEqual(status, 200, body)
        return json.loads(body)["content"]

    def test_return_token_ids(self):
        # Greedy, this chat answer ends with the end-of-turn token within 24 tokens.
        chat = [{"role": "user", "content": "What is 2+2? Answer in one word."}]
        for kind in ("completion", "chat"):
            with self.subTest(kind=kind):
                api = self.client.completions if kind == "completion" else \
                    self.client.chat.completions
                prompt = {"prompt": PROMPT} if kind == "completion" else {"messages": chat}
                args = dict(model=self.model, max_tokens=24, temperature=0, **prompt)
                whole = api.create(**args, extra_body={"return_token_ids": True})
                choice = whole.choices[0]
                text = choice.text if kind == "completion" else choice.message.content
                ids = choice.model_extra["token_ids"]
                self.assertEqual(len(ids), whole.usage.completion_tokens)
                if kind == "chat":  # the end-of-generation token is an id but no text
                    self.assertEqual(choice.finish_reason, "stop")
                    self.assertEqual(self.detokenize(ids[-1:]), "<|im_end|>")
                    ids_shown = ids[:-1]
                else:
                    self.assertEqual(choice.finish_reason, "length")
                    ids_shown = ids
                self.assertEqual(self.detokenize(ids_shown), text)

                chunks = list(api.create(**args, stream=True,
                                         extra_body={"return_token_ids": True}))
                self.assertTrue(all(isinstance(c.choices[0].model_extra["token_ids"], list)
                                    for c in chunks))
                self.assertEqual([i for c in chunks for i in c.choices[0].model_extra["token_ids"]],
                                 ids)

                plain = api.create(**args)  # not asked: no token_ids
                self.assertNotIn("token_ids", plain.choices[0].model_extra)
                chunks = list(api.create(**args, stream=True))
                self.assertFalse(any("token_ids" in c.choices[0].model_extra for c in chunks))

    # --- curl ------------------------------------------------------------------------------

    def curl(self, path, body, *extra):
        result = subprocess.run(
            ["curl", "-sS", "-N", "--max-time", "60", "-H", "Content-Type: application/json",
             *extra, "--data-binary", "@-", self.server.http_url + path],
            input=json.dumps(body).encode(), capture_output=True, check=True)
        return result.stdout.decode()

    def test_curl(self):
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        whole = json.loads(self.curl("/v1/completions", body))
        self.assertEqual(whole["object"], "text_completion")
        events, done = sse_events(self.curl("/v1/completions", {**body, "stream": True}))
        self.assertTrue(done)
        self.assertEqual("".join(e["choices"][0]["text"] for e in events),
                         whole["choices"][0]["text"])

        chat = {"messages": CHAT, "max_tokens": 10, "temperature": 0}
        whole = json.loads(self.curl("/v1/chat/completions", chat))
        events, done = sse_events(self.curl("/v1/chat/completions", {**chat, "stream": True}))
        self.assertTrue(done)
        self.assertEqual("".join(e["choices"][0]["delta"].get("content", "") for e in events),
                         whole["choices"][0]["message"]["content"])

    def test_curl_expect_100_continue(self):
        # curl sends the body only after the server's "100 Continue" (or after
        # --expect100-timeout seconds without one).
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "padding": "x" * 4000}
        start = time.monotonic()
        whole = json.loads(self.curl("/v1/completions", body, "-H", "Expect: 100-continue",
                                     "--expect100-timeout", "30"))
        self.assertEqual(whole["usage"]["completion_tokens"], 2)
        self.assertLess(time.monotonic() - start, 20)

    # --- the other routes ------------------------------------------------------------------

    def test_models(self):
        models = self.client.models.list().data
        self.assertEqual([m.id for m in models], [self.model])
        self.assertEqual(models[0].object, "model")
        self.assertEqual(self.client.models.retrieve(self.model).id, self.model)
        with self.assertRaises(openai.NotFoundError):
            self.client.models.retrieve("no-such-model")

    def test_health(self):
        status, headers, body = http_request(self.server.http_url + "/health")
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body), {"status": "ok"})

    def test_metrics_count_requests(self):
        status, headers, body = http_request(self.server.http_url + "/metrics")
        self.assertEqual(status, 200)
        self.assertTrue(headers["content-type"].startswith("text/plain; version=0.0.4"))
        text = body.decode()
        for name in ("duet_requests_total", "duet_time_to_first_token_seconds",
                     "duet_time_per_output_token_seconds", "duet_running_sequences",
                     "duet_kv_blocks_free", "duet_kv_blocks_total"):
            self.assertIn(f"# TYPE {name} ", text)
        before = parse_metrics(text)
        self.client.completions.create(model=self.model, prompt=PROMPT, max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
        after = self.metrics()
        key = 'duet_requests_total{outcome="length"}'
        self.assertEqual(after[key], before.get(key, 0) + 1)
        self.assertEqual(after["duet_time_to_first_token_seconds_count"],
                         before["duet_time_to_first_token_seconds_count"] + 1)

    def test_keep_alive(self):
        import http.client
        connection = http.client.HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        try:
            for _ in range(3):
                connection.request("POST", "/v1/completions", body=json.dumps(
                    {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}))
                response = connection.getresponse()
                self.assertEqual(response.status, 200)
                self.assertEqual(response.getheader("Content-Type"), "text/event-stream")
                events, done = sse_events(response.read().decode())
                self.assertTrue(done)
                connection.request("GET", "/health")
                self.assertEqual(connection.getresponse().read(), b'{"status":"ok"}')
        finally:
            connection.close()

    def test_pipelined_requests(self):
        body = json.dumps({"prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                   + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        closing = request.replace(b"Host: duet\r\n", b"Host: duet\r\nConnection: close\r\n")
        with socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30) as sock:
            sock.sendall(request + request + closing)  # all three before any answer
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        self.assertEqual(reply.count(b"HTTP/1.1 200 OK\r\n"), 3, reply)
        texts = {json.loads(part.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]
                 for part in reply.split(b"HTTP/1.1 ")[1:]}
        self.assertEqual(len(texts), 1)

    def test_http_1_0_stream(self):
        # No chunked coding in HTTP/1.0: the stream ends when the connection does.
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        whole = json.loads(self.curl("/v1/completions", body, "--http1.0"))
        events, done = sse_events(self.curl("/v1/completions", {**body, "stream": True},
                                            "--http1.0"))
        self.assertTrue(done)
        self.assertEqual("".join(e["choices"][0]["text"] for e in events),
                         whole["choices"][0]["text"])

    # --- clients that go away --------------------------------------------------------------

    def open_request(self, body):
        """A raw socket that has sent one POST /v1/completions."""
        data = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", self.server.http_port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        return sock

    def assert_cancelled_promptly(self, before, started):
        after = self.wait_until_idle()
        key = 'duet_requests_total{outcome="cancelled"}'
        self.assertEqual(after.get(key, 0), before.get(key, 0) + 1)
        # 4000 tokens would take far longer than this on any machine that runs the suite.
        self.assertLess(time.monotonic() - started, 10)

    def test_disconnect_mid_stream_cancels(self):
        before = self.wait_until_idle()
        started = time.monotonic()
        sock = self.open_request({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                                  "temperature": 0, "stream": True})
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(4096)
            self.assertTrue(chunk, "the server closed the stream early")
            received += chunk
        self.assertTrue(received.startswith(b"HTTP/1.1 200 OK\r\n"))
        sock.close()
        self.assert_cancelled_promptly(before, started)

    def test_disconnect_before_whole_response_cancels(self):
        before = self.wait_until_idle()
        started = time.monotonic()
        sock = self.open_request({"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
                                  "temperature": 0})
        deadline = time.monotonic() + 10
        while self.metrics()["duet_running_sequences"] < 1:  # generating
            self.assertLess(time.monotonic(), deadline)
            time.sleep(0.02)
        sock.close()
        self.assert_cancelled_promptly(before, started)


if __name__ == "__main__":
    unittest.main(verbosity=2)
