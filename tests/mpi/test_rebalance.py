"""Online rebalancing (`duet serve --rebalance auto --slo ttft=MS,tpot=MS`).

- test_1_refusals: --rebalance auto without --slo, or with a malformed one,
  ends the cluster at start with one clear line; a single-process server
  refuses the flag too.
- test_2_prompts_waiting_move_a_decode_instance_to_prefill: a 1P+2D cluster
  with a TTFT target far below what bursts of long prompts on one prefill
  instance give, and a TPOT target far above any step: the rebalancer moves
  the less busy decode instance to prefill (logged with its reason, counted
  in /metrics, shown in duet-client stats), and no more than that one while
  the cooldown lasts. Every answer, before, during and after, is the
  single-process `duet generate`'s.

Run by ctest (tests/mpi/mpi_tests.cmake) with DUET_BINARY, DUET_MODEL and
DUET_MPIEXEC set.
"""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpirun_serve import (MPIRUN_FLAGS, BackToBack, MpirunServe, complete,  # noqa: E402
                          every_block_free, metrics, run, stop_every_rank, wait_until, words)
from test_failover import generate  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "serve"))
from serve_process import serve_environment  # noqa: E402

CLUSTER = ["--prefill", "1", "--decode", "2", "--kv-cache-mem", "64MiB"]
# About 400 tokens each: a burst of them queues at the one prefill instance.
PROMPTS = [f"Repeat these words in order. {words(300, seed)}" for seed in range(4)]
MAX_TOKENS = 8


def greedy(prompt):
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def decisions(server, role):
    return int(metrics(server).get(f'duet_rebalance_decisions_total{{to="{role}"}}', 0))


class RebalanceTest(unittest.TestCase):
    def test_1_refusals(self):
        binary, model = serve_environment()
        mpirun = os.environ.get("DUET_MPIEXEC", "mpirun")
        cases = [
            (["--rebalance", "auto"], "--rebalance auto needs --slo ttft=MS,tpot=MS"),
            (["--rebalance", "auto", "--slo", "ttft=fast"],
             "--slo: ttft=fast is not a positive number of milliseconds"),
        ]
        for extra, says in cases:
            code, out = run([mpirun, *MPIRUN_FLAGS, "-np", "3", binary, "serve", "--model", model,
                             "--threads", "1", "--http-port", "0", "--rpc-port", "0",
                             "--prefill", "1", "--decode", "1", *extra], timeout=120)
            self.assertNotEqual(code, 0, out)
            self.assertIn(says, out)
        code, out = run([binary, "serve", "--model", model, "--http-port", "0", "--rpc-port", "0",
                         "--rebalance", "auto", "--slo", "ttft=100"], timeout=60)
        self.assertEqual(code, 2, out)
        self.assertIn("--rebalance auto needs a cluster (mpirun)", out)

    def test_2_prompts_waiting_move_a_decode_instance_to_prefill(self):
        serve_environment()  # SkipTest without the model
        expected = {p: generate(greedy(p)) for p in PROMPTS}
        server = MpirunServe(4, CLUSTER + ["--rebalance", "auto", "--slo", "ttft=150,tpot=5000"])
        server.start()
        try:
            # Back-to-back requests: the prefill instance always has a queue.
            load = BackToBack(server, PROMPTS, greedy, expected, 6)
            try:
                decision = re.compile(r"rebalancer: instance [12] decode -> prefill: TTFT p90 "
                                      r"\d+ ms over the SLO's 150 ms while TPOT p90 \d+ ms is "
                                      r"under 80% of 5000 ms")
                wait_until(lambda: decision.search("\n".join(server.log_lines())), 180,
                           "the rebalancer to move an instance to prefill")
                # The second decode instance must stay: it is the last one
                # that decodes (and the cooldown holds every move for 10 s).
                wait_until(lambda: re.search(r"instance [12]: now prefill",
                                             "\n".join(server.log_lines())), 60,
                           "the change to take effect")
            finally:
                load.stop()
            self.assertEqual(load.failures, [])
            self.assertEqual(decisions(server, "prefill"), 1)
            self.assertEqual(decisions(server, "decode"), 0)
            binary, _ = serve_environment()
            stats = subprocess.run(
                [os.path.join(os.path.dirname(binary), "duet-client"), "--connect",
                 f"{server.rpc_host}:{server.rpc_port}", "stats"],
                capture_output=True, text=True, timeout=30, check=True).stdout
            roles = [line.split()[2] for line in stats.splitlines() if line.startswith("instance ")]
            self.assertEqual(sorted(roles), ["decode", "prefill", "prefill"])
            self.assertEqual(metrics(server)["duet_instance_role_changes_total"], 1)
            for prompt in PROMPTS[:2]:
                r = complete(server, greedy(prompt))
                self.assertEqual(r["choices"][0]["text"], expected[prompt])
            wait_until(lambda: every_block_free(server), 30, "every KV block free")
        finally:
            if server.process.poll() is None:
                stop_every_rank(server, timeout=60)


if __name__ == "__main__":
    unittest.main()
