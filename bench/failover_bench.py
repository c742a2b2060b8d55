"""What a lost instance costs: time from SIGKILL (or SIGSTOP) of a decode
rank to the next token of each request that was on it, and the CPU the
whole cluster spends idle (heartbeats included).

A coordinator, one prefill and two decode instances (`mpirun
--enable-recovery -np 4 duet serve --prefill 1 --decode 2`, one thread a
rank), 12 concurrent streaming completions (6 greedy, 6 seeded, 96 tokens),
then one decode rank is killed or stopped. For every stream that was on it
(its final `duet` timings say retries >= 1), the pause is the time from the
signal to its next token. Rounds alternate kill and stop; the report gives
the median and the maximum over all such streams, per signal.

Idle cost: the ranks' CPU time (utime + stime from /proc) over --idle
seconds with nothing to do, as a percentage of one core, all ranks together.

Idle is measured alternately with --lease and with a lease of an hour (no
heartbeat in the window), --idle-rounds times each: the difference is the
heartbeats' cost.

usage: python3 bench/failover_bench.py [--rounds 3] [--lease 3] [--idle 20]
                                       [--idle-rounds 3]
  (DUET_BINARY, DUET_MODEL as for the tests; DUET_MPIEXEC names mpirun)
"""

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "mpi"))
from mpirun_serve import MpirunServe, wait_until  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "A haiku about the sea:", "To make bread, first"]


class TimedStream(threading.Thread):
    """One streaming completion: the arrival time of each token, and its retries."""

    def __init__(self, port, body):
        super().__init__()
        self.port, self.body = port, body
        self.times = []
        self.retries = 0
        self.error = None

    def run(self):
        data = json.dumps(self.body).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=300) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: duet\r\n"
                      + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            buffer = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return
                now = time.monotonic()
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.decode().splitlines():
                        if not line.startswith("data: "):
                            continue
                        payload = line[len("data: "):]
                        if payload == "[DONE]":
                            return
                        message = json.loads(payload)
                        if "error" in message:
                            self.error = message["error"]
                            continue
                        if message["choices"][0].get("text"):
                            self.times.append(now)
                        if "duet" in message:
                            self.retries = message["duet"].get("retries", 0)


def bodies():
    out = []
    for i, prompt in enumerate(PROMPTS):
        out.append({"prompt": prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
                    "stream": True})
        out.append({"prompt": prompt, "max_tokens": 96, "temperature": 0.8, "seed": 7 + i,
                    "ignore_eos": True, "stream": True})
    return out


def one_round(lease, sig):
    """Pauses (s) of the streams that were on the signalled instance."""
    server = MpirunServe(4, ["--prefill", "1", "--decode", "2", "--instance-lease", str(lease)],
                         mpirun_args=["--enable-recovery"])
    server.start()
    try:
        streams = [TimedStream(server.http_port, b) for b in bodies()]
        for s in streams:
            s.start()
        wait_until(lambda: all(len(s.times) >= 4 for s in streams), 120, "tokens on every stream")
        victim = server.rank_pids()[2]
        signalled = time.monotonic()
        os.kill(victim, sig)
        for s in streams:
            s.join(300)
        if sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
        pauses = []
        for s in streams:
            if s.error:
                raise RuntimeError(f"a stream failed: {s.error}")
            if s.retries:
                after = [t for t in s.times if t > signalled]
                pauses.append(after[0] - signalled)
        return pauses
    finally:
        server.stop(30.0, False)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cost(lease, seconds):
    server = MpirunServe(4, ["--prefill", "1", "--decode", "2", "--instance-lease", str(lease)],
                         mpirun_args=["--enable-recovery"])
    server.start()
    try:
        time.sleep(3)  # past start-up
        pids = list(server.rank_pids().values())
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(seconds)
        after = sum(cpu_seconds(p) for p in pids)
        return 100.0 * (after - before) / seconds
    finally:
        server.stop(30.0, False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lease", type=float, default=3.0)
    parser.add_argument("--idle", type=float, default=20.0)
    parser.add_argument("--idle-rounds", type=int, default=3)
    args = parser.parse_args()
    pauses = {"SIGKILL": [], "SIGSTOP": []}
    for r in range(args.rounds):
        for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
            got = one_round(args.lease, sig)
            pauses[name] += got
            print(f"round {r + 1} {name}: {len(got)} streams re-run, pauses "
                  + " ".join(f"{p:.2f}" for p in sorted(got)) + " s", flush=True)
    for name, values in pauses.items():
        if values:
            print(f"{name}, lease {args.lease:g} s: {len(values)} re-run streams, signal to next "
                  f"token median {statistics.median(values):.2f} s, max {max(values):.2f} s")
    # Idle, alternating the lease with one so long that no heartbeat is sent
    # in the window: the difference is what the heartbeats cost.
    idle = {args.lease: [], 3600.0: []}
    for _ in range(args.idle_rounds):
        for lease in idle:
            idle[lease].append(idle_cost(lease, args.idle))
    for lease, values in idle.items():
        print(f"idle, lease {lease:g} s: median {statistics.median(values):.2f}% of one core "
              f"({' '.join(f'{v:.2f}' for v in values)}), 4 ranks together, over {args.idle:g} s")


if __name__ == "__main__":
    main()
