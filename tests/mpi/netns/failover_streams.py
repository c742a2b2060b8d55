"""The client side of netns_failover_test.sh, run on host a: streaming
completions to the cluster, a decode rank on another host SIGKILLed while a
long prompt's KV flows to it, and every answer checked.

Usage: failover_streams.py URL EXPECTED_JSON VICTIM_PID VICTIM_NAMESPACE [replaced]

EXPECTED_JSON: a list of {"prompt", "max_tokens", "text"} (single-process
`duet generate`'s greedy texts), the short prompts first, then the long ones.
The short prompts stream first; once tokens flow on each, the long prompts
go in one after another, until the victim's host receives KV (over 256 KiB
on its veth since the long prompt went in, where tokens and heartbeats are a
few hundred bytes, and still arriving); then the victim is killed. A prompt's
KV is sent layer by layer as its prefill computes it, so on a loaded machine
it trickles: the bytes are counted from the prompt's start, not per poll. Checks: every stream ends with its expected text
and no error, at least one was re-run, /health says degraded (with
`replaced`: says ok again within a minute, a replacement having joined), and
a new request is served. Prints one line per stream; exit 0 when all hold.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from mpirun_serve import SseStream  # noqa: E402

PATIENCE_S = 60.0  # any one wait


def Stream(host, port, body):  # noqa: N802 - reads as the class it makes
    return SseStream(host, port, {**body, "temperature": 0, "stream": True}, PATIENCE_S)


def rx_bytes(namespace):
    return int(subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/sys/class/net/duet0/statistics/rx_bytes"],
        capture_output=True, text=True, check=True, timeout=10).stdout)


def wait_until(predicate, what):
    deadline = time.monotonic() + PATIENCE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def request(url, method="GET", body=None):
    import http.client
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=PATIENCE_S)
    try:
        connection.request(method, parts.path, body=json.dumps(body) if body else None,
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def main():
    url, expected_path, victim, victim_namespace = sys.argv[1:5]
    replaced = sys.argv[5:] == ["replaced"]
    victim = int(victim)
    expected = json.load(open(expected_path))
    parts = urllib.parse.urlsplit(url)
    short = [e for e in expected if len(e["prompt"]) < 200]
    long = [e for e in expected if len(e["prompt"]) >= 200]
    streams = [Stream(parts.hostname, parts.port, {"prompt": e["prompt"],
                                                   "max_tokens": e["max_tokens"]})
               for e in short]
    for stream in streams:
        stream.start()
    wait_until(lambda: all(s.events >= 2 or s.done for s in streams), "tokens on every stream")
    killed = False
    for e in long:
        stream = Stream(parts.hostname, parts.port, {"prompt": e["prompt"],
                                                     "max_tokens": e["max_tokens"]})
        streams.append(stream)
        stream.start()
        start = before = rx_bytes(victim_namespace)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not stream.done:
            time.sleep(0.02)
            now = rx_bytes(victim_namespace)
            if now - start > 256 * 1024 and now > before:
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                print(f"killed rank pid {victim} with KV flowing to it "
                      f"({now - start} bytes since the prompt went in)", flush=True)
                break
            before = now
        if killed:
            break
    if not killed:
        print("FAIL: no long prompt's KV went to the victim's host", flush=True)
        return 1
    for stream in streams:
        stream.join(PATIENCE_S * 2)
    failures = []
    for stream, want in zip(streams, short + long):
        prompt = want["prompt"][:40]
        ok = (stream.failure is None and stream.error is None and stream.done
              and stream.text == want["text"])
        print(f"{'ok  ' if ok else 'FAIL'} {prompt!r}: retries {stream.retries}, "
              f"{len(stream.text)} chars", flush=True)
        if not ok:
            failures.append(f"{prompt!r}: failure {stream.failure}, error {stream.error}, "
                            f"done {stream.done}, got {stream.text!r}, want {want['text']!r}")
    if not any(s.retries for s in streams):
        failures.append("no stream was re-run: nothing was on the killed instance")
    status, body = request(url + "/health")
    if replaced:
        # Capacity back: the replacement joined, and a loss made up for is ok.
        deadline = time.monotonic() + PATIENCE_S
        while (status != 200 or json.loads(body).get("status") != "ok" or
               json.loads(body).get("joined", 0) < 1) and time.monotonic() < deadline:
            time.sleep(0.1)
            status, body = request(url + "/health")
        print(f"/health {body.decode()} {time.monotonic() - killed:.1f} s after the kill",
              flush=True)
    if status != 200 or json.loads(body).get("status") != ("ok" if replaced else "degraded"):
        failures.append(f"/health: {status} {body[:200]!r}")
    status, body = request(url + "/v1/completions", "POST",
                           {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    if status != 200:
        failures.append(f"a new request after the loss: {status} {body[:200]!r}")
    for failure in failures:
        print("FAIL: " + failure, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
