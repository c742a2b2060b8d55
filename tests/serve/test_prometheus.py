"""A real Prometheus server scrapes `duet serve`, and the Grafana dashboard's
queries find what they ask for.

1. Every metric a panel of docs/grafana/duet.json queries is in /metrics
   (read as text, no Prometheus needed).
2. Debian's `prometheus` scrapes a single-process `duet serve` and a 1 prefill
   + 1 decode cluster under mpirun every second. After a known number of
   requests, its HTTP API answers: both targets up, the request counters
   equal what was sent, TTFT/TPOT quantiles finite and positive, and every
   panel's query (with Grafana's variables filled in) returns data.

The `prometheus` binary comes from launch/setup.sh; PROMETHEUS may name
another. Its absence is a failure, not a skip.
"""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "mpi"))
from mpirun_serve import MpirunServe  # noqa: E402
from serve_process import ServeProcess, http_request, parse_metrics  # noqa: E402

DASHBOARD = os.path.join(HERE, "..", "..", "docs", "grafana", "duet.json")
SCRAPE_INTERVAL_S = 1
N_REQUESTS = 4
MAX_TOKENS = 6


def dashboard_queries():
    """Every PromQL expression of the dashboard's panels and variables."""
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def metric_names(query):
    """The duet_ metric families a query reads (histogram series by family)."""
    names = set(re.findall(r"\bduet_[a-z_]+", query))
    return {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def filled_in(query, window):
    """A panel's query as Grafana sends it: every job, `window` for $__rate_interval."""
    return query.replace("$__rate_interval", window).replace("$job", ".*")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(server, prompt):
    status, _, body = http_request(server.http_url + "/v1/completions", "POST",
                                   {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                    "temperature": 0, "ignore_eos": True})
    if status != 200:
        raise AssertionError(f"{status}: {body[:300]!r}")


class Prometheus:
    """`prometheus` scraping `targets` ({job: "host:port"}) every second."""

    def __init__(self, targets):
        binary = os.environ.get("PROMETHEUS") or shutil.which("prometheus")
        if not binary:
            raise AssertionError("no prometheus binary: launch/setup.sh installs it")
        self.dir = tempfile.mkdtemp(prefix="duet-prometheus-")
        config = os.path.join(self.dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
                    f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\nscrape_configs:\n")
            for job, target in targets.items():
                f.write(f"  - job_name: {job}\n    static_configs:\n"
                        f"      - targets: ['{target}']\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(os.path.join(self.dir, "prometheus.log"), "w+")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir}/data",
             f"--web.listen-address={self.url[len('http://'):]}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_until(lambda: http_request(self.url + "/-/ready", timeout=5)[0] == 200,
                        60, "prometheus ready")

    def close(self):
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-3000:]

    def api(self, path, **params):
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            reply = json.load(response)
        if reply.get("status") != "success":
            raise AssertionError(f"{path} {params}: {reply}")
        return reply["data"]

    def query(self, expr):
        """{job or "": float} of an instant query's vector."""
        data = self.api("query", query=expr)
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr}: a {data['resultType']}, not a vector")
        return {r["metric"].get("job", ""): float(r["value"][1]) for r in data["result"]}

    def wait_until(self, predicate, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.log_tail()}")
            try:
                if predicate():
                    return
            except (OSError, AssertionError):
                pass
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log_tail()}")


class DashboardMetricsTest(unittest.TestCase):
    def test_every_panel_metric_is_served(self):
        with ServeProcess() as server:
            complete(server, "Hello")
            status, _, body = http_request(server.http_url + "/metrics")
            self.assertEqual(status, 200)
        families = set(re.findall(r"^# TYPE (\S+) ", body.decode(), re.M))
        wanted = set().union(*(metric_names(q) for q in dashboard_queries()))
        self.assertGreaterEqual(len(wanted), 10, wanted)
        self.assertEqual(wanted - families, set(), "queried by a panel, absent from /metrics")


class PrometheusScrapeTest(unittest.TestCase):
    def test_prometheus_scrapes_a_server_and_a_cluster(self):
        single = ServeProcess()
        cluster = MpirunServe(3, ["--prefill", "1", "--decode", "1"])
        prometheus = None
        try:
            single.start()
            cluster.start()
            servers = {"single": single, "cluster": cluster}
            prometheus = Prometheus(
                {job: f"127.0.0.1:{s.http_port}" for job, s in servers.items()})
            prometheus.wait_until(lambda: prometheus.query("up == 1").keys() == servers.keys(),
                                  60, "both targets up")
            # A scrape before the traffic, so that rate() sees it arrive.
            prometheus.wait_until(
                lambda: prometheus.query("duet_engine_steps_total").keys() == servers.keys(),
                60, "a first scrape of both")
            for server in servers.values():
                for i in range(N_REQUESTS):
                    complete(server, f"Request number {i} says")
            for job, server in servers.items():
                served = parse_metrics(http_request(server.http_url + "/metrics")[2].decode())
                self.assertEqual(served['duet_requests_total{outcome="length"}'], N_REQUESTS, job)

            # Prometheus holds what the servers counted.
            prometheus.wait_until(
                lambda: prometheus.query('duet_requests_total{outcome="length"}') ==
                {job: N_REQUESTS for job in servers}, 60, "the request counters scraped")
            # Two more scrapes, so a window holds samples on both sides of the traffic.
            time.sleep(2.5 * SCRAPE_INTERVAL_S)
            window = "1m"
            for family in ("duet_time_to_first_token_seconds",
                           "duet_time_per_output_token_seconds"):
                for quantile in (0.5, 0.99):
                    expr = (f"histogram_quantile({quantile}, sum by (job, le) "
                            f"(rate({family}_bucket[{window}])))")
                    values = prometheus.query(expr)
                    self.assertEqual(values.keys(), servers.keys(), expr)
                    for job, value in values.items():
                        self.assertTrue(math.isfinite(value) and value > 0, f"{job}: {expr} = {value}")
            tokens = prometheus.query(f"increase(duet_completion_tokens_total[{window}])")
            for job in servers:
                self.assertGreater(tokens[job], 0, job)
            self.assertEqual(prometheus.query("sum by (job) (duet_instance_up)"),
                             {"single": 1.0, "cluster": 2.0})

            # Every panel's query, as Grafana would send it, returns data.
            for query in dashboard_queries():
                if query.startswith("label_values("):
                    jobs = prometheus.api("label/job/values", **{"match[]": "duet_requests_total"})
                    self.assertEqual(set(jobs), set(servers), query)
                    continue
                data = prometheus.api("query", query=filled_in(query, window))
                self.assertTrue(data["result"], f"no data for {query}")
        finally:
            if prometheus is not None:
                prometheus.close()
            cluster.stop(check=False)
            single.stop(check=False)


if __name__ == "__main__":
    unittest.main(verbosity=2)
