"""Every door of Duet gives the same token ids for the same request.

The product's promise: a prompt gets the same tokens whichever way it comes
in. The reference is the single-prompt path, `duet generate --prompt`
(--token-ids prints `token_ids: [...]` on stderr); every other door must
match it id for id, end-of-generation token included:

  batch     `duet generate --prompts-file` (one batched run per kind and mode;
            its JSON lines carry "token_ids");
  http      `duet serve`, one process, over HTTP with "return_token_ids";
  capnp     the same server over Cap'n Proto with includeTokenIds;
  cluster   `mpirun -np 3 duet serve --prefill 1 --decode 1`, over HTTP;
  tp2       `mpirun -np 3 duet serve --mode colocated --tp 2`, over HTTP (for a
            mixture of experts: EP=2, the experts split over the two ranks);
  ep        for a mixture of experts (DUET_EXPERT_PARALLEL=1): `mpirun -np 4 duet
            serve --prefill 1 --decode 1 --prefill-ep 1 --decode-ep 2`, a prefill
            instance holding every expert shipping KV to a decode instance of two
            ranks that hold half each, over HTTP.

And the reference's greedy ids equal llama.cpp's `llama-server` (one slot,
`-np 1 -fa off --no-repack`, default batch sizes, no prompt cache), recorded
in llama_server_greedy.json by make_llama_server_golden.py: on the CPU a lone
sequence reproduces it, token for token.

The prompts are tests/consistency/prompts.json: each runs greedily and with
the file's seeded sampling settings; `chat` ones are one user turn through
the model's chat template. The serving doors get all requests of a mode at
once, so that they batch; the sampled requests follow the greedy ones, so
their prompts come from the prefix cache. Every door prefills at most 64
tokens a step, so the long prompts are prefilled in several chunks.

Run by ctest (tests/consistency/consistency_tests.cmake) with DUET_BINARY,
DUET_MODEL and DUET_MPIEXEC set; exits 77 (skipped) without the model. With
DUET_CONSISTENCY_PROMPTS naming another prompt set, the same doors run a
model family's tiny fixture (family_prompts.json: text prompts, no
llama-server fixture).
"""

import asyncio
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "mpi"))
sys.path.insert(0, os.path.join(HERE, "..", "serve"))
import capnp  # noqa: E402
from mpirun_serve import MpirunServe  # noqa: E402
from serve_process import ServeProcess, http_request, serve_environment  # noqa: E402
from test_pycapnp import Sink, login, schema  # noqa: E402
from test_pycapnp import run as run_on_kj_loop  # noqa: E402

STEP_TOKENS = ["--step-tokens", "64"]
ENGINE = ["--kv-cache-mem", "128MiB", *STEP_TOKENS]
THREADS = ["--threads", "1"]
TIMEOUT_S = 120  # one process or one request
MODES = ("greedy", "sampled")

# DUET_CONSISTENCY_PROMPTS names another prompt set (a model family's, whose
# tiny fixture has no chat template and no llama-server fixture).
with open(os.environ.get("DUET_CONSISTENCY_PROMPTS", os.path.join(HERE, "prompts.json")),
          encoding="utf-8") as f:
    SPEC = json.load(f)
PROMPTS = SPEC["prompts"]
SAMPLED = SPEC["sampled"]


def max_tokens(prompt):
    return prompt.get("max_tokens", SPEC["max_tokens"])


def cases():
    """(prompt, mode) for every prompt and mode, in a fixed order."""
    return [(p, mode) for mode in MODES for p in PROMPTS]


def first_difference(got, want):
    """The first position where the lists differ (past the shorter one's end: its length)."""
    n = min(len(got), len(want))
    return next((i for i in range(n) if got[i] != want[i]), n)


def describe(door, prompt, mode, got, want):
    at = first_difference(got, want)
    got_id = got[at] if at < len(got) else "<end>"
    want_id = want[at] if at < len(want) else "<end>"
    kind = "chat" if prompt.get("chat") else "text"
    return (f"{door}: prompt {prompt['name']!r} ({kind}), {mode}: token {at} is {got_id}, "
            f"duet generate's is {want_id} ({len(got)} ids vs {len(want)})")


# --- the doors: each returns {(name, mode): [ids]} ------------------------------------------


def generate_command(binary, model, mode, chat):
    command = [binary, "generate", "--model", model, *THREADS]
    if chat:
        command.append("--chat")
    if mode == "sampled":
        command += ["--temp", str(SAMPLED["temperature"]), "--top-p", str(SAMPLED["top_p"]),
                    "--seed", str(SAMPLED["seed"])]
    return command


def run(command, what):
    result = subprocess.run(command, capture_output=True, text=True, errors="replace",
                            timeout=TIMEOUT_S)
    if result.returncode != 0:
        raise AssertionError(f"{what} exited with {result.returncode}:\n{result.stderr[-2000:]}")
    return result


def single_prompt_ids(binary, model):
    """The reference: one `duet generate --prompt` per prompt and mode."""
    ids = {}
    for prompt, mode in cases():
        command = [*generate_command(binary, model, mode, prompt.get("chat", False)),
                   *STEP_TOKENS, f"--prompt={prompt['text']}", "-n", str(max_tokens(prompt)),
                   "--token-ids"]
        stderr = run(command, f"duet generate --prompt ({prompt['name']!r}, {mode})").stderr
        lines = [line for line in stderr.splitlines() if line.startswith("token_ids: ")]
        if len(lines) != 1:
            raise AssertionError(f"duet generate printed {len(lines)} 'token_ids: [...]' lines on "
                                 f"stderr for {prompt['name']!r}, {mode}:\n{stderr[-2000:]}")
        ids[prompt["name"], mode] = json.loads(lines[0][len("token_ids: "):])
    return ids


def batch_ids(binary, model):
    """One `duet generate --prompts-file` per kind (text, chat) and mode."""
    ids = {}
    for chat in (False, True):
        prompts = [p for p in PROMPTS if p.get("chat", False) == chat]
        if not prompts:
            continue
        n_tokens = {max_tokens(p) for p in prompts}
        assert len(n_tokens) == 1, "a batched run has one -n: give its prompts one max_tokens"
        for p in prompts:
            assert "\n" not in p["text"] and p["text"], f"{p['name']}: not one line of a file"
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as file:
            file.write("".join(p["text"] + "\n" for p in prompts))
            file.flush()
            for mode in MODES:
                command = [*generate_command(binary, model, mode, chat), *ENGINE,
                           f"--prompts-file={file.name}", "-n", str(*n_tokens)]
                what = f"duet generate --prompts-file ({'chat' if chat else 'text'}, {mode})"
                lines = [json.loads(line) for line in run(command, what).stdout.splitlines()
                         if line.startswith("{")]
                assert len(lines) == len(prompts), (len(lines), len(prompts))
                for line in lines:
                    assert "token_ids" in line, f"a --prompts-file line has no token_ids: {line}"
                    ids[prompts[line["index"]]["name"], mode] = line["token_ids"]
    return ids


def http_body(prompt, mode):
    body = {"max_tokens": max_tokens(prompt), "return_token_ids": True}
    if prompt.get("chat"):
        body["messages"] = [{"role": "user", "content": prompt["text"]}]
    else:
        body["prompt"] = prompt["text"]
    if mode == "sampled":
        body.update(SAMPLED)
    else:
        body["temperature"] = 0
    return body


def http_ids(server):
    """Every request of a mode at once, one connection each."""
    def post(prompt, mode):
        path = "/v1/chat/completions" if prompt.get("chat") else "/v1/completions"
        status, _, reply = http_request(server.http_url + path, "POST", http_body(prompt, mode),
                                        timeout=TIMEOUT_S)
        assert status == 200, f"{prompt['name']!r}, {mode}: HTTP {status}: {reply[:500]!r}"
        return json.loads(reply)["choices"][0]["token_ids"]

    ids = {}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        for mode in MODES:
            futures = {p["name"]: pool.submit(post, p, mode) for p in PROMPTS}
            for name, future in futures.items():
                ids[name, mode] = future.result()
    return ids


def capnp_ids(server):
    """Every request of a mode at once, on one Cap'n Proto connection."""
    async def generate(inference, prompt, mode):
        request = inference.generate_request()
        fields = request.request
        if prompt.get("chat"):
            message = fields.prompt.init("chat", 1)[0]
            message.role = "user"
            message.content = prompt["text"]
        else:
            fields.prompt.text = prompt["text"]
        fields.maxTokens = max_tokens(prompt)
        fields.includeTokenIds = True
        if mode == "sampled":
            fields.sampling.temperature = SAMPLED["temperature"]
            fields.sampling.topP = SAMPLED["top_p"]
            fields.sampling.seed = SAMPLED["seed"]
        sink = Sink()
        request.sink = sink
        result = (await request.send()).result
        assert result.which() == "started", f"{prompt['name']!r}, {mode}: {result}"
        handle = result.started.handle  # held: dropping it would cancel
        finish = await sink.finished
        del handle
        assert finish["reason"] in ("stop", "length"), f"{prompt['name']!r}, {mode}: {finish}"
        return sink.token_ids

    async def body():
        stream = await capnp.AsyncIoStream.create_connection(server.rpc_host, server.rpc_port)
        client = capnp.TwoPartyClient(stream)
        inference = await login(client.bootstrap().cast_as(schema.Gateway))
        ids = {}
        for mode in MODES:
            got = await asyncio.gather(*(generate(inference, p, mode) for p in PROMPTS))
            ids.update({(p["name"], mode): g for p, g in zip(PROMPTS, got)})
        return ids

    return run_on_kj_loop(body)


# --- the test --------------------------------------------------------------------------------

reference = None
summary = []  # one line per door, printed together at the end


def setUpModule():
    global reference
    binary, model = serve_environment()
    started = time.monotonic()
    reference = single_prompt_ids(binary, model)
    summary.append(f"reference  duet generate --prompt: {len(reference)} generations, "
                   f"{sum(map(len, reference.values()))} ids, {time.monotonic() - started:.1f} s")


def tearDownModule():
    print("\ntoken ids of every door against the single-prompt path:\n  " + "\n  ".join(summary),
          file=sys.stderr)


class DoorsTest(unittest.TestCase):
    def check(self, door, what, get_ids):
        """Asserts that `get_ids()` equals the reference; adds the door's line to the summary."""
        started = time.monotonic()
        try:
            ids = get_ids()
        except Exception as e:
            summary.append(f"{door:<9}  {what}: failed ({type(e).__name__}, see below)")
            raise
        seconds = time.monotonic() - started
        mismatches = []
        for p, mode in cases():
            got, want = ids.get((p["name"], mode), []), reference[p["name"], mode]
            if got != want:
                mismatches.append(describe(door, p, mode, got, want))
        n = len(cases())
        summary.append(f"{door:<9}  {what}: {n - len(mismatches)} of {n} identical, "
                       f"{seconds:.1f} s")
        if mismatches:
            self.fail(f"{len(mismatches)} of {n} generations differ from duet generate --prompt:\n"
                      + "\n".join(mismatches))

    def test_1_batched_generate(self):
        binary, model = serve_environment()
        self.check("batch", "duet generate --prompts-file", lambda: batch_ids(binary, model))

    def test_2_single_process_serve(self):
        with ServeProcess(ENGINE) as server:
            with self.subTest(door="http"):
                self.check("http", "duet serve over HTTP", lambda: http_ids(server))
            with self.subTest(door="capnp"):
                self.check("capnp", "duet serve over Cap'n Proto", lambda: capnp_ids(server))

    def test_3_disaggregated_cluster(self):
        with MpirunServe(3, ["--prefill", "1", "--decode", "1", *ENGINE]) as cluster:
            self.check("cluster", "mpirun: 1 prefill + 1 decode instance, HTTP",
                       lambda: http_ids(cluster))

    def test_0_llama_server(self):
        if not SPEC.get("llama_server", True):
            self.skipTest("this prompt set has no llama-server fixture (its family's logits are "
                          "checked against llama.cpp in tests/worker/model/)")
        with open(os.path.join(HERE, "llama_server_greedy.json"), encoding="utf-8") as f:
            golden = json.load(f)
        self.assertEqual(golden["max_tokens"], SPEC["max_tokens"])
        # Prompts where Duet differs from llama-server on purpose (prompts.json
        # says why): still compared across Duet's own doors.
        apart = {p["name"] for p in PROMPTS if p.get("not_llama_server")}
        mismatches = []
        for entry in golden["prompts"]:
            if entry["name"] in apart:
                continue
            got = reference[entry["name"], "greedy"]
            want = entry["generated_ids"]
            if got != want:
                at = first_difference(got, want)
                margin = entry["margins"][at] if at < len(entry["margins"]) else None
                mismatches.append(f"prompt {entry['name']!r}: token {at} is "
                                  f"{got[at] if at < len(got) else '<end>'}, llama-server's "
                                  f"{want[at] if at < len(want) else '<end>'} (its top-2 logit "
                                  f"margin there: {margin})")
        n = len(golden["prompts"]) - len(apart)
        summary.append(f"{'llama':<9}  llama-server's greedy ids (fixture): "
                       f"{n - len(mismatches)} of {n} identical"
                       + (f" ({len(apart)} apart on purpose: {', '.join(sorted(apart))})"
                          if apart else ""))
        if mismatches:
            self.fail("duet generate's greedy ids differ from llama-server's:\n"
                      + "\n".join(mismatches))

    def test_4_tensor_parallel_instance(self):
        with MpirunServe(3, ["--mode", "colocated", "--tp", "2", *ENGINE]) as cluster:
            self.check("tp2", "mpirun: one colocated TP=2 instance, HTTP",
                       lambda: http_ids(cluster))

    def test_5_expert_parallel_disaggregated(self):
        if os.environ.get("DUET_EXPERT_PARALLEL") != "1":
            self.skipTest("not a mixture-of-experts model")
        with MpirunServe(4, ["--prefill", "1", "--decode", "1", "--prefill-ep", "1",
                             "--decode-ep", "2", *ENGINE]) as cluster:
            self.check("ep", "mpirun: 1 prefill (EP=1) + 1 decode (EP=2) instance, HTTP",
                       lambda: http_ids(cluster))


if __name__ == "__main__":
    try:
        serve_environment()
    except unittest.SkipTest as skip:
        print(f"skipped: {skip}", file=sys.stderr)
        sys.exit(77)
    unittest.main(verbosity=2)
