"""Soak: a 1 prefill + 1 decode cluster under steady load with cancellations
and disconnects mixed in, watched for errors, memory growth, leaked KV blocks
and latency drift.

1. Starts `mpirun --enable-recovery -np 3 duet serve --prefill 1 --decode 1`
   (one thread a rank).
2. Saturation: a closed loop of --concurrency streaming completions for
   --saturation-s seconds; completed requests per second is the saturation rate.
3. Soak: Poisson arrivals at --load x that rate for --duration seconds, each
   request one of
     75% a streamed completion read to its end (TTFT and TPOT recorded),
     10% a stream whose client disconnects after a few tokens,
      5% a request whose client disconnects before its first token,
     10% `duet-client generate` (Cap'n Proto) interrupted by SIGINT, which
         cancels the request on the server.
   Prompts are 40 to 160 words, max_tokens 32 to 128, greedy and seeded.
4. Reports: errors (any failure but the intended ones), every rank's RSS after
   the first minute (a third of a shorter run) and at the end, KV blocks in use once idle, and per minute
   the requests finished and TTFT/TPOT p50/p99.

usage: python3 bench/soak.py [--duration 1200] [--load 0.8] [--json soak.json]
  (DUET_BINARY, DUET_MODEL, DUET_CLIENT as for the tests; DUET_MPIEXEC names mpirun)
"""

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "mpi"))
from mpirun_serve import MpirunServe, metrics, wait_until  # noqa: E402

WORDS = ("the a river stone light morning city market garden letter voice window "
         "mountain story engine signal harbor winter paper island forest bridge clock "
         "music number question answer student teacher kitchen table ocean travel").split()
OPENERS = ["Write about", "Explain", "Tell a story of", "Describe", "List facts about",
           "Summarize"]


def prompt(rng):
    return rng.choice(OPENERS) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160)))


def body(rng):
    b = {"prompt": prompt(rng), "max_tokens": rng.randint(32, 128), "stream": True,
         "ignore_eos": True}
    if rng.random() < 0.5:
        b["temperature"] = 0
    else:
        b.update(temperature=0.8, seed=rng.randint(0, 1 << 30))
    return b


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class Stream:
    """One streamed completion over a raw socket: token arrival times, or a
    disconnect after `stop_after` events (0: before any)."""

    def __init__(self, port, request, stop_after=None):
        self.port, self.request, self.stop_after = port, request, stop_after

    def run(self):
        """{"ok", "ttft", "tpot", "error"}"""
        data = json.dumps(self.request).encode()
        start = time.monotonic()
        times = []
        finish = None
        with socket.create_connection(("127.0.0.1", self.port), timeout=600) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                      b"Content-Type: application/json\r\n"
                      + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            if self.stop_after == 0:
                return {"ok": True}
            buffer = b""
            head = None
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buffer += chunk
                if head is None:
                    if b"\r\n\r\n" not in buffer:
                        continue
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    if not head.startswith(b"HTTP/1.1 200"):
                        return {"ok": False, "error": head.split(b"\r\n")[0].decode()}
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        payload = line[6:]
                        if payload == b"[DONE]":
                            ok = finish in ("length", "stop")
                            ttft = times[0] - start if times else None
                            tpot = ((times[-1] - times[0]) / (len(times) - 1)
                                    if len(times) > 1 else None)
                            return {"ok": ok, "ttft": ttft, "tpot": tpot,
                                    "error": None if ok else f"finish {finish}"}
                        message = json.loads(payload)
                        if "error" in message:
                            return {"ok": False, "error": json.dumps(message["error"])[:200]}
                        choice = message["choices"][0] if message.get("choices") else None
                        if choice is None:
                            continue
                        if choice.get("text"):
                            times.append(time.monotonic())
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                        if self.stop_after is not None and len(times) >= self.stop_after:
                            return {"ok": True}  # the disconnect
        return {"ok": False, "error": "connection closed before [DONE]"}


class Soak:
    def __init__(self, server, client, rng):
        self.server, self.client, self.rng = server, client, rng
        self.lock = threading.Lock()
        self.results = []  # (start offset s, kind, result)
        self.threads = []

    def one(self, kind, request, t0, seed):
        start = time.monotonic() - t0
        try:
            if kind == "complete":
                result = Stream(self.server.http_port, request).run()
            elif kind == "disconnect_mid":
                result = Stream(self.server.http_port, request,
                                stop_after=random.Random(seed).randint(1, 8)).run()
            elif kind == "disconnect_early":
                result = Stream(self.server.http_port, request, stop_after=0).run()
            else:
                result = self.cancel_over_rpc(request, random.Random(seed).uniform(0.2, 2.0))
        except Exception as e:  # noqa: BLE001 - every failure is counted
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        with self.lock:
            self.results.append((start, kind, result))

    def cancel_over_rpc(self, request, after_s):
        command = [self.client, "--connect", f"127.0.0.1:{self.server.rpc_port}", "generate",
                   "--prompt", request["prompt"], "-n", str(request["max_tokens"]),
                   "--ignore-eos", "--temp", str(request.get("temperature", 0))]
        p = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(after_s)
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=600)
        # 130: cancelled by the Ctrl-C; 0: it had finished first.
        ok = p.returncode in (0, 130)
        return {"ok": ok, "error": None if ok else f"exit {p.returncode}: {err.decode()[-200:]}"}

    def closed_loop(self, concurrency, seconds):
        """Completed streamed requests per second with `concurrency` in flight."""
        t0 = time.monotonic()
        done = []

        def worker(i):
            rng = random.Random(1000 + i)
            while time.monotonic() - t0 < seconds:
                r = Stream(self.server.http_port, body(rng)).run()
                if not r["ok"]:
                    raise RuntimeError(f"saturation request failed: {r['error']}")
                done.append(time.monotonic())

        workers = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        finished_in_window = [t for t in done if t - t0 <= seconds]
        return len(finished_in_window) / seconds

    def open_loop(self, rate, seconds, on_first_minute):
        t0 = time.monotonic()
        next_arrival = 0.0
        marked = False
        i = 0
        while True:
            next_arrival += self.rng.expovariate(rate)
            if next_arrival >= seconds:
                break
            delay = t0 + next_arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if not marked and time.monotonic() - t0 >= min(60.0, seconds / 3):
                on_first_minute()
                marked = True
            u = self.rng.random()
            kind = ("complete" if u < 0.75 else "disconnect_mid" if u < 0.85
                    else "disconnect_early" if u < 0.90 else "rpc_cancel")
            t = threading.Thread(target=self.one, args=(kind, body(self.rng), t0, i))
            t.start()
            self.threads.append(t)
            i += 1
        for t in self.threads:
            t.join()
        return time.monotonic() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=1200, help="soak seconds")
    parser.add_argument("--load", type=float, default=0.8, help="fraction of saturation")
    parser.add_argument("--concurrency", type=int, default=16, help="saturation's closed loop")
    parser.add_argument("--saturation-s", type=float, default=90)
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args()
    client = os.environ.get("DUET_CLIENT") or os.path.join(
        os.path.dirname(os.environ["DUET_BINARY"]), "duet-client")

    server = MpirunServe(3, ["--prefill", "1", "--decode", "1", "--kv-cache-mem", "512MiB"],
                         mpirun_args=["--enable-recovery"])
    server.start()
    try:
        soak = Soak(server, client, random.Random(7))
        print(f"saturation: closed loop of {args.concurrency} for {args.saturation_s:.0f} s",
              file=sys.stderr)
        saturation = soak.closed_loop(args.concurrency, args.saturation_s)
        rate = args.load * saturation
        print(f"saturation {saturation:.3f} req/s; soaking at {rate:.3f} req/s for "
              f"{args.duration:.0f} s", file=sys.stderr)
        wait_until(lambda: metrics(server)["duet_active_requests"] == 0, 120, "idle")
        pids = server.rank_pids()
        rss_start = {}
        elapsed = soak.open_loop(rate, args.duration,
                                 lambda: rss_start.update({r: rss_kib(p) for r, p in pids.items()}))
        rss_end = {r: rss_kib(p) for r, p in pids.items()}
        wait_until(lambda: metrics(server)["duet_active_requests"] == 0, 120, "idle")
        m = metrics(server)
        blocks_in_use = (m["duet_kv_blocks_total"] - m["duet_kv_blocks_free"]
                         - m["duet_kv_blocks_quarantined"])
    finally:
        server.stop(check=False)

    errors = [(s, k, r["error"]) for s, k, r in soak.results if not r["ok"]]
    minutes = []
    for minute in range(int(elapsed // 60) + 1):
        rows = [r for s, k, r in soak.results
                if k == "complete" and r["ok"] and minute * 60 <= s < (minute + 1) * 60]
        ttft = [r["ttft"] for r in rows if r["ttft"] is not None]
        tpot = [r["tpot"] for r in rows if r["tpot"] is not None]
        if rows:
            minutes.append({"minute": minute + 1, "completed": len(rows),
                            "ttft_p50_ms": 1000 * percentile(ttft, 50),
                            "ttft_p99_ms": 1000 * percentile(ttft, 99),
                            "tpot_p50_ms": 1000 * percentile(tpot, 50),
                            "tpot_p99_ms": 1000 * percentile(tpot, 99)})
    kinds = {}
    for _, k, _ in soak.results:
        kinds[k] = kinds.get(k, 0) + 1
    report = {
        "saturation_rps": saturation, "rate_rps": rate, "duration_s": elapsed,
        "requests": kinds, "errors": len(errors), "error_samples": errors[:10],
        "rss_kib_start": rss_start, "rss_kib_end": rss_end,
        "kv_blocks_in_use_idle": blocks_in_use, "minutes": minutes,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)

    print(f"\nsaturation {saturation:.3f} req/s, soak at {rate:.3f} req/s for {elapsed:.0f} s; "
          f"requests {kinds}")
    print(f"errors: {len(errors)}")
    for e in errors[:10]:
        print(f"  at {e[0]:.0f} s, {e[1]}: {e[2]}")
    print("| rank | RSS after 1 min (MiB) | RSS at end (MiB) | change |\n|---|---:|---:|---:|")
    for r in sorted(rss_end):
        a, b = rss_start.get(r, float("nan")), rss_end[r]
        print(f"| {r} | {a / 1024:.1f} | {b / 1024:.1f} | {100 * (b - a) / a:+.1f}% |")
    print(f"KV blocks in use once idle: {blocks_in_use:.0f}")
    print("| minute | completed | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for m in minutes:
        print(f"| {m['minute']} | {m['completed']} | {m['ttft_p50_ms']:.0f} | "
              f"{m['ttft_p99_ms']:.0f} | {m['tpot_p50_ms']:.1f} | {m['tpot_p99_ms']:.1f} |")
    rss_ok = all(abs(rss_end[r] - rss_start[r]) <= 0.05 * rss_start[r] for r in rss_end
                 if r in rss_start)
    return 0 if not errors and blocks_in_use == 0 and rss_ok else 1


if __name__ == "__main__":
    sys.exit(main())
