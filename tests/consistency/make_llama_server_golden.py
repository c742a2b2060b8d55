#!/usr/bin/env python3
"""Make tests/consistency/llama_server_greedy.json: llama-server's greedy answers
to the prompts of tests/consistency/prompts.json, as token ids.

The reference is llama.cpp's `llama-server` built from the llama.cpp that the
llama-cpp-python 0.3.36 source distribution bundles (bench/build_llama_cpp.sh
with TARGETS=llama-server). The prompt token ids come from Duet's tokenizer
(`duet serve`'s POST /tokenize), so both sides start from the same ids; chat
prompts are rendered as `duet generate --chat` renders them (one user turn in
ChatML, no system prompt added) and tokenized with special tokens parsed.
llama-server's own POST /tokenize is asked as well, and whether it agrees is
recorded per prompt.

    python3 tests/consistency/make_llama_server_golden.py \
        [--llama-server PATH] [--duet PATH] [--model PATH] [--out FILE]

Defaults, relative to the repository root: .cache/llama.cpp-build/bin/llama-server,
build/tools/duet, models/SmolLM2-135M-Instruct.Q4_1.gguf and
tests/consistency/llama_server_greedy.json.

llama-server runs on loopback with one slot, no flash attention, no weight
repacking and one thread (LLAMA_SERVER_FLAGS). Every request asks for greedy
sampling (top-k 1 as the only sampler, temperature 0), no prompt cache, the
generated token ids, and the two most likely tokens of every step before
sampling, whose log-probability gap (the logit gap) is recorded as the step's
margin: a small margin marks a near-tie that another implementation may
legitimately break the other way. Generation is not cut at the end of
generation token: it is recorded among the ids, with the stop reason.

Only the standard library is used. Both servers are stopped on every path.
"""

import argparse
import datetime
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS_FILE = os.path.join(REPO_ROOT, "tests", "consistency", "prompts.json")

FORMAT_NAME = "duet-llama-server-greedy"
FORMAT_VERSION = 1
REFERENCE_SOURCE = "llama.cpp bundled with the llama-cpp-python 0.3.36 source distribution"

# llama-server's flags besides the model, host and port: one slot, flash
# attention off, no weight repacking, one thread, a 4096-token context, default
# batch sizes (-b 2048 -ub 512).
LLAMA_SERVER_FLAGS = ["-np", "1", "-fa", "off", "--no-repack", "-t", "1", "-c", "4096"]

# The fields every POST /completion carries besides "prompt" and "n_predict".
COMPLETION_FIELDS = {
    "temperature": 0,        # greedy ...
    "top_k": 1,              # ... and top-1 is the only sampler left before
    "samplers": ["top_k"],   # the final draw, so nothing else can change the pick
    "cache_prompt": False,   # every prompt evaluated from scratch
    "return_tokens": True,   # the generated ids, the end of generation token included
    "n_probs": 2,            # the two most likely tokens of each step, before sampling
    "post_sampling_probs": False,
    "stream": False,
}

STARTUP_TIMEOUT_S = 180.0   # a server loading the model
REQUEST_TIMEOUT_S = 300.0   # one HTTP request (a 24-token generation on one thread)
STOP_TIMEOUT_S = 30.0       # a server leaving after SIGTERM

_DUET_LISTENING = re.compile(r"^http listening on (\S+):(\d+)$")


def render_chatml_user_turn(text):
    """One user turn in ChatML with the assistant's turn opened, exactly as
    Duet's apply_chat_template (common/text/chat_template.cpp) renders it for
    `duet generate --chat`: no default system prompt."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def http_json(host, port, method, path, body=None, timeout=REQUEST_TIMEOUT_S):
    """One request on a new loopback connection: (status, decoded JSON or None)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=payload,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, None
    finally:
        connection.close()


def post_ok(host, port, path, body):
    """POST that must answer 200; returns the decoded JSON body."""
    status, reply = http_json(host, port, "POST", path, body)
    if status != 200:
        raise RuntimeError(f"POST {path} answered {status}: {reply}")
    return reply


def free_loopback_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (llama-server takes a
    fixed --port; the start is retried should another process take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess whose stderr (and stdout unless read) goes to a
    temporary log file; stop() sends SIGTERM, waits, then kills."""

    def __init__(self, name, command):
        self.name = name
        self.command = command
        self.process = None
        self.log = tempfile.TemporaryFile(mode="w+b")

    def start(self, read_stdout=None):
        """Starts the process; read_stdout(line) is called, on a thread, for each
        stdout line when given (stdout joins the log otherwise)."""
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if read_stdout else self.log, stderr=self.log)
        if read_stdout:
            def reader():
                for raw in self.process.stdout:
                    read_stdout(raw.decode("utf-8", "replace").rstrip("\n"))
            threading.Thread(target=reader, daemon=True).start()

    def exited(self):
        return self.process is not None and self.process.poll() is not None

    def log_tail(self, n=30):
        self.log.flush()
        self.log.seek(0)
        lines = self.log.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def fail(self, why):
        """Raises RuntimeError with `why` and the last lines of the log."""
        raise RuntimeError(f"{self.name}: {why}\n--- last lines of its log ---\n{self.log_tail()}")

    def stop(self):
        """SIGTERM, up to STOP_TIMEOUT_S to leave, then SIGKILL. Idempotent."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                try:
                    self.process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(STOP_TIMEOUT_S)
            if self.process.stdout:
                self.process.stdout.close()
            self.process = None
        self.log.close()


def stop_all(servers):
    """Stops every server in the list, each one even if another fails, and
    empties the list."""
    while servers:
        server = servers.pop()
        try:
            server.stop()
        except Exception as error:  # noqa: BLE001 -- the others must still stop
            print(f"warning: stopping {server.name}: {error}", file=sys.stderr)


def start_duet(duet, model, servers):
    """`duet serve` on loopback with any free ports; returns (host, port) once it
    listens. The server is appended to `servers` before it starts: the caller
    stops it, on every path."""
    server = ServerProcess("duet serve", [
        duet, "serve", "--model", model, "--host", "127.0.0.1",
        "--http-port", "0", "--rpc-port", "0", "--threads", "1"])
    servers.append(server)
    address = {}
    ready = threading.Event()

    def read_stdout(line):
        match = _DUET_LISTENING.match(line.strip())
        if match:
            address["host"], address["port"] = match.group(1), int(match.group(2))
            ready.set()

    server.start(read_stdout)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not ready.wait(0.1):
        if server.exited():
            server.fail(f"exited with code {server.process.returncode} before listening")
        if time.monotonic() > deadline:
            server.fail(f"did not listen within {STARTUP_TIMEOUT_S:.0f} s")
    return address["host"], address["port"]


def start_llama_server(llama_server, model, servers, attempts=3):
    """llama-server on 127.0.0.1; returns its port once GET /health says the
    model is loaded. Each server is appended to `servers` before it starts: the
    caller stops them, on every path."""
    tail = ""
    for _ in range(attempts):
        port = free_loopback_port()
        server = ServerProcess("llama-server", [
            llama_server, "-m", model, *LLAMA_SERVER_FLAGS,
            "--host", "127.0.0.1", "--port", str(port)])
        servers.append(server)
        server.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not server.exited():  # an early exit: perhaps the port was taken
            try:
                status, _ = http_json("127.0.0.1", port, "GET", "/health", timeout=5)
                if status == 200:
                    return port
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                server.fail(f"not healthy within {STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.2)
        tail = server.log_tail()
        server.stop()
    raise RuntimeError(f"llama-server did not start in {attempts} attempts:\n{tail}")


def llama_server_version(llama_server):
    """What `llama-server --version` prints (its build number and commit), one line."""
    try:
        result = subprocess.run([llama_server, "--version"], stdin=subprocess.DEVNULL,
                                capture_output=True, text=True, errors="replace", timeout=60)
    except subprocess.TimeoutExpired:
        return "unknown (--version timed out)"
    lines = (result.stdout + result.stderr).splitlines()
    version = [l.strip() for l in lines if l.strip().startswith("version:")]
    built = [l.strip() for l in lines if l.strip().startswith("built with")]
    return "; ".join(version + built) or "unknown"


def cpu_model_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def duet_prompt_ids(host, port, prompts):
    """Each prompt's ids from Duet's tokenizer, as `duet generate` makes them.

    Duet's POST /tokenize always parses special-token text, which
    `duet generate --chat` does too (on the rendered template); plain prompts
    must then hold no special-token text, which the llama-server cross-check
    (parse_special off for them) would reveal. add_special=true adds BOS only
    where the model asks for it, as `duet generate` does. For chat prompts the
    count is checked against what Duet's own chat route reports, so a drift of
    render_chatml_user_turn from common/text/chat_template.cpp is caught.
    """
    ids = {}
    for p in prompts:
        chat = bool(p.get("chat"))
        text = render_chatml_user_turn(p["text"]) if chat else p["text"]
        tokens = post_ok(host, port, "/tokenize", {"content": text, "add_special": True})["tokens"]
        if chat:
            reply = post_ok(host, port, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": p["text"]}],
                "max_tokens": 1, "temperature": 0})
            n_route = reply["usage"]["prompt_tokens"]
            if n_route != len(tokens):
                raise RuntimeError(f"{p['name']}: Duet's chat route counts {n_route} prompt "
                                   f"tokens, the rendered template {len(tokens)}")
        ids[p["name"]] = tokens
    return ids


def step_margins(reply, generated):
    """(margins, runner-up ids) per generated token from completion_probabilities:
    the log-probability gap between the two most likely tokens before sampling
    (the logit gap), rounded to 1e-4. Raises if a pick was not the most likely."""
    probabilities = reply.get("completion_probabilities")
    if not probabilities:
        return None, None
    if len(probabilities) != len(generated):
        raise RuntimeError(f"{len(probabilities)} probability entries for "
                           f"{len(generated)} generated tokens")
    margins, runner_up = [], []
    for step, (entry, token) in enumerate(zip(probabilities, generated)):
        top = entry["top_logprobs"]
        if top[0]["id"] != token:
            raise RuntimeError(f"step {step}: picked {token}, most likely {top[0]['id']}")
        margins.append(round(top[0]["logprob"] - top[1]["logprob"], 4))
        runner_up.append(top[1]["id"])
    return margins, runner_up


def generate(port, prompt, prompt_ids, max_tokens):
    """One greedy completion on llama-server; the prompt's entry of the golden file."""
    reply = post_ok("127.0.0.1", port, "/completion",
                    {"prompt": prompt_ids, "n_predict": max_tokens, **COMPLETION_FIELDS})
    generated = reply["tokens"]
    if reply.get("tokens_evaluated") != len(prompt_ids):
        raise RuntimeError(f"llama-server evaluated {reply.get('tokens_evaluated')} prompt "
                           f"tokens, sent {len(prompt_ids)}")
    margins, runner_up = step_margins(reply, generated)
    entry = {
        "name": prompt["name"],
        "chat": bool(prompt.get("chat")),
        "prompt_ids": prompt_ids,
        "generated_ids": generated,
        "stop": reply["stop_type"],  # "eos" (end of generation token, kept above) or "limit"
        "text": reply["content"],    # for reading only; the ids are the golden
    }
    if margins is not None:
        entry["margins"] = margins
        entry["runner_up_ids"] = runner_up
    return entry


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=os.path.join(
        REPO_ROOT, ".cache", "llama.cpp-build", "bin", "llama-server"))
    parser.add_argument("--duet", default=os.path.join(REPO_ROOT, "build", "tools", "duet"))
    parser.add_argument("--model", default=os.path.join(
        REPO_ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--out", default=os.path.join(
        REPO_ROOT, "tests", "consistency", "llama_server_greedy.json"))
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks below stop the servers.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for path in (args.llama_server, args.duet, args.model):
        if not os.path.isfile(path):
            parser.error(f"{path} does not exist")

    with open(PROMPTS_FILE, encoding="utf-8") as f:
        spec = json.load(f)
    # Prompts where Duet differs from llama-server on purpose are left out
    # (prompts.json says why for each).
    prompts = [p for p in spec["prompts"] if not p.get("not_llama_server")]
    max_tokens = spec["max_tokens"]

    # 1. Prompt ids from Duet's tokenizer.
    servers = []  # every server started, stopped in the finally blocks
    try:
        host, port = start_duet(args.duet, args.model, servers)
        ids = duet_prompt_ids(host, port, prompts)
    finally:
        stop_all(servers)

    # 2. Greedy generations from llama-server.
    version = llama_server_version(args.llama_server)
    entries, disagreements = [], []
    try:
        port = start_llama_server(args.llama_server, args.model, servers)
        for p in prompts:
            chat = bool(p.get("chat"))
            text = render_chatml_user_turn(p["text"]) if chat else p["text"]
            # llama-server's own tokenization, special tokens parsed only in chat
            # prompts (as `duet generate` does).
            own = post_ok("127.0.0.1", port, "/tokenize", {
                "content": text, "add_special": True, "parse_special": chat})["tokens"]
            entry = generate(port, p, ids[p["name"]], max_tokens)
            entry["llama_server_tokenizer_agrees"] = own == ids[p["name"]]
            if not entry["llama_server_tokenizer_agrees"]:
                disagreements.append(p["name"])
            entries.append(entry)
            margins = entry.get("margins") or [float("nan")]
            print(f"{p['name']:<12} prompt {len(entry['prompt_ids']):4d} tokens, "
                  f"tokenizers {'agree' if entry['llama_server_tokenizer_agrees'] else 'DIFFER'}; "
                  f"{len(entry['generated_ids']):2d} generated ({entry['stop']}), "
                  f"min margin {min(margins):.3f}: {entry['text']!r}", flush=True)
    finally:
        stop_all(servers)

    model_name = os.path.basename(args.model)
    golden = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "about": "Greedy token ids of llama-server for tests/consistency/prompts.json, from "
                 "prompt ids made by Duet's tokenizer; margins are the logit gaps between the "
                 "two most likely tokens of each step (small: a near-tie). Made by "
                 "tests/consistency/make_llama_server_golden.py.",
        "reference": {
            "source": REFERENCE_SOURCE,
            "llama_server_version": version,
            "command": " ".join(["llama-server", "-m", model_name, *LLAMA_SERVER_FLAGS,
                                 "--host", "127.0.0.1", "--port", "PORT"]),
            "request": {"prompt": "[prompt_ids]", "n_predict": max_tokens, **COMPLETION_FIELDS},
        },
        "model": model_name,
        "cpu": cpu_model_name(),
        "date": datetime.date.today().isoformat(),
        "max_tokens": max_tokens,
        "prompts": entries,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, args.out)
    print(f"wrote {args.out} ({len(entries)} prompts); tokenizers "
          + (f"differ on {', '.join(disagreements)}" if disagreements else "agree on all"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
