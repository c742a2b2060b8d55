"""The Cap'n Proto protocol from Python: pycapnp against the real `duet serve`.

Loads common/duet.capnp, logs in, asks for the model info, round-trips
tokenize/detokenize, streams a generation into a TokenSink implemented here
(its text must equal detokenize(tokenIds)), cancels one, and checks that a
refusal arrives typed. Run by ctest with DUET_BINARY and DUET_MODEL set.
"""

import asyncio
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import capnp  # noqa: E402

from serve_process import start_shared, stop_shared  # noqa: E402

SOURCE_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# "/capnp/c++.capnp" resolves against pycapnp's bundled copy or the system's.
schema = capnp.load(os.path.join(SOURCE_DIR, "common", "duet.capnp"),
                    imports=[os.path.dirname(os.path.dirname(capnp.__file__)), "/usr/include"])

TIMEOUT_S = 60
server = None


def setUpModule():
    global server
    server = start_shared(["--kv-cache-mem", "256MiB"])


def tearDownModule():
    stop_shared(server)


class Sink(schema.TokenSink.Server):
    """Collects the chunks; `finished` resolves with the Finish as a dict."""

    def __init__(self):
        self.text = ""
        self.token_ids = []
        self.n_writes = 0
        self.first_write = asyncio.get_running_loop().create_future()
        self.finished = asyncio.get_running_loop().create_future()

    async def write(self, chunk, **kwargs):
        # Readers live only during the call: copy.
        self.text += chunk.text
        self.token_ids += list(chunk.tokenIds)
        self.n_writes += 1
        if not self.first_write.done():
            self.first_write.set_result(None)

    async def done(self, finish, **kwargs):
        t = finish.timings
        self.finished.set_result({
            "reason": str(finish.reason),
            "completion_tokens": t.completionTokens,
            "prompt_tokens": t.promptTokens,
            "ttft_ms": t.ttftMs,
            "e2e_ms": t.e2eMs,
            "error": str(finish.error.kind) if str(finish.reason) == "error" else None,
        })


async def connect():
    stream = await capnp.AsyncIoStream.create_connection(server.rpc_host, server.rpc_port)
    client = capnp.TwoPartyClient(stream)
    gateway = client.bootstrap().cast_as(schema.Gateway)
    return client, gateway


async def login(gateway):
    result = (await gateway.login(apiKey="")).result
    assert result.which() == "inference", result
    return result.inference


def run(coroutine_function):
    async def main():
        async with capnp.kj_loop():
            return await asyncio.wait_for(coroutine_function(), TIMEOUT_S)
    return asyncio.run(main())


def start_generation(inference, sink, prompt, max_tokens, ignore_eos=False, model=""):
    request = inference.generate_request()
    request.request.prompt.text = prompt
    request.request.maxTokens = max_tokens
    request.request.ignoreEos = ignore_eos
    request.request.includeTokenIds = True
    request.request.model = model
    request.sink = sink
    return request.send()


class PycapnpClientTest(unittest.TestCase):
    def test_version_and_model_info(self):
        async def body():
            _client, gateway = await connect()
            version = await gateway.version()
            self.assertEqual(version.protocolVersion, schema.protocolVersion)
            inference = await login(gateway)
            info = (await inference.modelInfo()).info
            self.assertTrue(info.name)
            self.assertGreater(info.contextLength, 0)
            self.assertEqual(info.vocabSize, 49152)
            self.assertGreater(info.kvCapacityTokens, 0)
            health = (await inference.health()).status
            self.assertEqual(str(health), "serving")
        run(body)

    def test_tokenize_detokenize_round_trip(self):
        async def body():
            _client, gateway = await connect()
            inference = await login(gateway)
            text = "The quick brown fox jumps over 13 lazy dogs."
            tokens = (await inference.tokenize(text=text, addSpecial=False)).result
            self.assertEqual(tokens.which(), "tokens")
            ids = list(tokens.tokens)
            self.assertGreater(len(ids), 5)
            back = (await inference.detokenize(tokens=ids)).result
            self.assertEqual(back.which(), "text")
            self.assertEqual(back.text, text)
        run(body)

    def test_streamed_generate(self):
        async def body():
            _client, gateway = await connect()
            inference = await login(gateway)
            sink = Sink()
            result = (await start_generation(inference, sink, "Once upon a time", 12)).result
            self.assertEqual(result.which(), "started")
            handle = result.started.handle  # held: dropping it would cancel
            self.assertGreater(result.started.promptTokens, 0)
            finish = await sink.finished
            del handle
            self.assertIn(finish["reason"], ("stop", "length"))
            self.assertEqual(finish["completion_tokens"], len(sink.token_ids))
            self.assertGreater(finish["ttft_ms"], 0.0)
            self.assertGreaterEqual(finish["e2e_ms"], finish["ttft_ms"])
            ids = sink.token_ids
            if finish["reason"] == "stop":
                ids = ids[:-1]  # the end-of-generation token is not shown as text
            else:
                self.assertEqual(len(ids), 12)
            back = (await inference.detokenize(tokens=ids)).result
            self.assertEqual(sink.text, back.text)
        run(body)

    def test_cancel_ends_the_stream(self):
        async def body():
            _client, gateway = await connect()
            inference = await login(gateway)
            sink = Sink()
            result = (await start_generation(inference, sink, "Tell me a long story.", 1000,
                                             ignore_eos=True)).result
            self.assertEqual(result.which(), "started")
            handle = result.started.handle
            await sink.first_write
            await handle.cancel()
            finish = await sink.finished
            self.assertEqual(finish["reason"], "cancelled")
            self.assertLess(finish["completion_tokens"], 1000)
            for _ in range(500):
                stats = (await inference.stats()).stats
                if stats.runningSequences == 0 and stats.kvBlocksFree == stats.kvBlocksTotal:
                    break
                await asyncio.sleep(0.01)
            self.assertEqual(stats.runningSequences, 0)
            self.assertEqual(stats.kvBlocksFree, stats.kvBlocksTotal)
        run(body)

    def test_refusal_is_typed(self):
        async def body():
            _client, gateway = await connect()
            inference = await login(gateway)
            result = (await start_generation(inference, Sink(), "Hi", 4,
                                             model="no-such-model")).result
            self.assertEqual(result.which(), "error")
            self.assertEqual(str(result.error.kind), "notFound")
            self.assertTrue(result.error.message)
            # The connection still serves.
            sink = Sink()
            result = (await start_generation(inference, sink, "Hi", 2, ignore_eos=True)).result
            self.assertEqual(result.which(), "started")
            handle = result.started.handle
            finish = await sink.finished
            del handle
            self.assertEqual(finish["reason"], "length")
        run(body)


class OversizeMessageTest(unittest.TestCase):
    """A message over the server's reader limits (sized from --max-prompt-tokens)
    ends that connection with the reason; a new connection is served."""

    def test_oversize_message_then_a_normal_request(self):
        from serve_process import ServeProcess
        with ServeProcess(["--kv-cache-mem", "64MiB", "--max-prompt-tokens", "64"]) as small:
            async def body():
                stream = await capnp.AsyncIoStream.create_connection(small.rpc_host,
                                                                     small.rpc_port)
                gateway = capnp.TwoPartyClient(stream).bootstrap().cast_as(schema.Gateway)
                inference = await login(gateway)
                # 16 MiB: under Cap'n Proto's default 64 MiB, far over what a
                # 64-token prompt can need.
                with self.assertRaises(Exception) as caught:
                    await start_generation(inference, Sink(), "a" * (16 << 20), 2)
                # The server aborts the connection saying "Message is too
                # large"; a client still writing the message sees its pipe break.
                self.assertRegex(str(caught.exception), "too large|disconnected|Broken pipe")

                stream = await capnp.AsyncIoStream.create_connection(small.rpc_host,
                                                                     small.rpc_port)
                gateway = capnp.TwoPartyClient(stream).bootstrap().cast_as(schema.Gateway)
                inference = await login(gateway)
                sink = Sink()
                result = (await start_generation(inference, sink, "Hi", 2, ignore_eos=True)).result
                self.assertEqual(result.which(), "started")
                handle = result.started.handle
                finish = await sink.finished
                del handle
                self.assertEqual(finish["reason"], "length")
            run(body)


if __name__ == "__main__":
    unittest.main()
