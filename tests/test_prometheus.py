"""deploy/'s alert rules and Grafana dashboard against a real Prometheus (Debian's `prometheus`
package ships `prometheus` and `promtool`; `.ci/run` installs it where it can, and these
tests skip, saying so, where it is absent):

- `promtool check rules` on the rule groups of deploy/prometheus-rules.yaml (a
  PrometheusRule: its spec.groups is a rules file), and `promtool test rules` with
  tests/prometheus_rules_test.yaml, where every alert has series that fire it and series
  that do not; the cases catch each alert's threshold moved.
- A real `llm-worker serve --metrics-port` (LoRA, speculation) scraped by a real Prometheus
  on loopback every second, with traffic of every kind the dashboard shows; then every
  PromQL expression of deploy/grafana-dashboard.json, evaluated through Prometheus' HTTP
  API, returns data (so no panel names a metric the worker does not export), and every
  alert rule, loaded into that Prometheus, evaluates without error.
- Without Prometheus: the worker's RPC counter by status agrees with the calls made.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from llmworker.v1 import worker_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families

from tests.test_metrics import MODEL, free_port, worker_with_metrics
from tests.test_server import GREEDY, Worker, run

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus-rules.yaml"
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
RULES_TEST = Path(__file__).with_name("prometheus_rules_test.yaml")
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
INSTALL = "Debian/Ubuntu: apt-get install prometheus (ships prometheus and promtool)"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=f"promtool not found; {INSTALL}")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None,
                                      reason=f"prometheus not found; {INSTALL}")
# What Grafana puts for its variables: a window every panel's rate() spans the whole test.
RATE_INTERVAL = "5m"
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}')
# Each threshold moved so that its firing case no longer fires (or a healthy replica does).
MOVED = {
    "LLMWorkerTimeToFirstTokenHigh": (") > 2\n", ") > 5\n"),
    "LLMWorkerQueueGrowing": ("> 4\n", "> 40\n"),
    "LLMWorkerKVCacheSaturated": ("> 0.9\n", "> 0.96\n"),
    "LLMWorkerErrorRate": ("> 0.05\n", "> 0.2\n"),
    "LLMWorkerReplicaNotReady": ("== 0\n", "== 1\n"),
}


def rule_groups() -> list[dict[str, Any]]:
    (rule,) = [d for d in yaml.safe_load_all(RULES.read_text()) if d]
    return rule["spec"]["groups"]


def write_rules(folder: Path, groups: list[dict[str, Any]] | None = None) -> Path:
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": groups or rule_groups()}, sort_keys=False))
    return path


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@needs_promtool
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    write_rules(tmp_path)
    done = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    n = sum(len(g["rules"]) for g in rule_groups())
    assert done.returncode == 0 and f"SUCCESS: {n} rules found" in done.stdout, (
        done.stdout + done.stderr)


@needs_promtool
def test_every_alert_fires_on_its_series_and_not_on_the_others(tmp_path: Path) -> None:
    alerts = {r["alert"] for g in rule_groups() for r in g["rules"]}
    assert alerts == set(MOVED)
    cases = yaml.safe_load(RULES_TEST.read_text())
    firing, silent = set(), set()
    for test in cases["tests"]:
        for case in test["alert_rule_test"]:
            (firing if case["exp_alerts"] else silent).add(case["alertname"])
            # A firing case also holds a replica that does not fire: fewer alerts than pods.
            if case["exp_alerts"]:
                pods = {re.search(r'pod="([^"]+)"', s["series"]).group(1)
                        for s in test["input_series"]}
                assert len(case["exp_alerts"]) < len(pods), case["alertname"]
    assert firing == silent == alerts
    write_rules(tmp_path)
    shutil.copy(RULES_TEST, tmp_path / RULES_TEST.name)
    done = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    # Each threshold matters: moved, its alert's cases fail.
    for alert, (old, new) in MOVED.items():
        groups = rule_groups()
        rule = next(r for g in groups for r in g["rules"] if r["alert"] == alert)
        assert rule["expr"].count(old) == 1, (alert, rule["expr"])
        rule["expr"] = rule["expr"].replace(old, new)
        write_rules(tmp_path, groups)
        done = promtool("test", "rules", RULES_TEST.name, cwd=tmp_path)
        assert done.returncode != 0 and alert in done.stdout + done.stderr, (alert, done.stdout)


# ----- a live worker, scraped -------------------------------------------------------------


def _make_lora(folder: Path) -> None:
    """The adapter .ci/run makes for the wheel's worker (numpy + safetensors, random)."""
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / ".ci" / "wheel_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_lora(folder)


class Traffic:
    """What the worker was sent: each kind the dashboard shows (a prefix-cache hit, a LoRA
    request, a structured one, drafts verified, a rejected one, a unary RPC)."""

    def __init__(self, w: Worker) -> None:
        stop = pb.StoppingCriteria(max_tokens=8, ignore_eos=True)
        shared = "The quick brown fox jumps over the lazy dog. " * 4
        self.generated = 0
        for fields in ({"text": shared}, {"text": shared}, {"text": shared, "lora_name": "ci"},
                       {"text": "A product code:", "regex": "[A-Z]{3}-[0-9]{4}"},
                       {"text": " ".join(["one two three four five six seven eight"] * 4),
                        "stopping": pb.StoppingCriteria(max_tokens=16, ignore_eos=True)}):
            _, c = run(w.stub, **{"sampling": GREEDY, "stopping": stop, **fields})
            assert c.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), c
            self.generated += 1
        self.drafts = c.spec_draft_tokens
        assert self.drafts > 0  # the repeating prompt speculated
        with pytest.raises(grpc.RpcError) as e:
            run(w.stub, text="hi", sampling=pb.SamplingParams(temperature=-1.0))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        w.stub.GetLoad(pb.GetLoadRequest(), timeout=10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, int]]:
    lora = tmp_path_factory.mktemp("lora") / "ci"
    _make_lora(lora)
    with worker_with_metrics("--enable-lora", "--lora-modules", f"ci={lora}",
                             "--speculative-config", SPEC) as served:
        yield served


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def handled(port: int) -> dict[str, float]:
    """llm_worker:grpc_server_handled_total as {"Method CODE": count}."""
    return {dict(k[1])["grpc_method"] + " " + dict(k[1])["grpc_code"]: v
            for k, v in scrape(port).items() if k[0] == "llm_worker:grpc_server_handled_total"}


def test_rpcs_are_counted_by_status(served: tuple[Worker, int]) -> None:
    w, port = served
    before = handled(port)
    traffic = Traffic(w)
    after = handled(port)
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert delta == {"Generate OK": traffic.generated, "Generate INVALID_ARGUMENT": 1,
                     "GetLoad OK": 1}


# What Prometheus 2.42 (Debian 12's) sends: OpenMetrics first.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_a_scraper_asking_for_openmetrics_gets_the_vllm_names(served: tuple[Worker, int]) -> None:
    """prometheus_client's OpenMetrics writer turns vllm:x into vllm_x on sample lines
    (client_python#1177); the worker answers every scraper in the text format instead."""
    _, port = served
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                 headers={"Accept": PROMETHEUS_ACCEPT})
    with urllib.request.urlopen(req, timeout=10) as r:
        kind, text = r.headers["Content-Type"], r.read().decode()
    assert kind.startswith("text/plain; version=0.0.4"), kind
    samples = [line.split("{")[0].split()[0] for line in text.splitlines()
               if line and not line.startswith("#")]
    assert "vllm:num_requests_waiting" in samples
    assert not [s for s in samples if s.startswith(("vllm_", "llm_worker_"))]


class Prometheus:
    """A Prometheus scraping one worker's metrics every second, with deploy/'s rules."""

    def __init__(self, folder: Path, target_port: int) -> None:
        assert PROMETHEUS
        write_rules(folder)
        self.port = free_port()
        (folder / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yaml"],
            "scrape_configs": [{"job_name": "llm-worker",
                                "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }))
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={folder / 'prometheus.yml'}",
             f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            cwd=folder, stdout=self.log, stderr=subprocess.STDOUT)
        self.folder = folder

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query: Prometheus says why
            raise AssertionError(f"{path} {params}: {e.code} {e.read()[:500]!r}") from None
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def wait(self, what: str, ok: Any, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while True:
            try:
                if ok():
                    return
            except (OSError, LookupError, ValueError, AssertionError):  # not yet
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.log.flush()
                raise AssertionError(f"Prometheus: {what}; its log:\n"
                                     + (self.folder / "prometheus.log").read_text()[-3000:])
            time.sleep(0.25)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def grafana(expr: str, models: list[str]) -> str:
    """The expression as Grafana sends it, with the dashboard's variables set: the selected
    models as a regex alternation (multi-value) and the rate interval."""
    assert all(re.fullmatch(r"[\w.-]+", m) for m in models), models  # nothing to escape
    alternation = "|".join(models)
    out = expr.replace("$model_name", alternation).replace("$__rate_interval", RATE_INTERVAL)
    assert "$" not in out, out  # no variable left that the test does not set
    return out


@needs_prometheus
def test_every_dashboard_expression_returns_data_from_a_scraped_worker(
        served: tuple[Worker, int, Traffic], tmp_path: Path) -> None:
    w, port = served
    Traffic(w)  # before Prometheus starts: every series exists at its first scrape
    prom = Prometheus(tmp_path, port)
    try:
        prom.wait("not ready", lambda: prom.get("/api/v1/status/runtimeinfo"))
        # Two scrapes, so that every rate() has two samples (a rate over one is no data).
        prom.wait("no two scrapes of the worker", lambda: float(prom.query(
            'count_over_time(up{job="llm-worker"}[1m])')[0]["value"][1]) >= 2 and float(
            prom.query('up{job="llm-worker"}')[0]["value"][1]) == 1)
        # Grafana's variable: the model names the label query finds.
        definition = next(v["definition"] for v in json.loads(DASHBOARD.read_text())[
            "templating"]["list"] if v["name"] == "model_name")
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", definition).groups()
        models = prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
        assert models == [MODEL]
        # More traffic now, so every rate() has an increase inside its window.
        Traffic(w)
        finished = sum(v for k, v in scrape(port).items() if k[0] == "vllm:request_success_total")
        prom.wait("the second traffic not scraped", lambda: float(prom.query(
            "sum(vllm:request_success_total)")[0]["value"][1]) == finished)
        empty, nan = [], []
        for title, expr in dashboard_targets():
            result = prom.query(grafana(expr, models))
            if not result:
                empty.append(f"{title}: {expr}")
            elif not all(math.isfinite(float(r["value"][1])) for r in result):
                nan.append(f"{title}: {expr} -> {result}")
        assert not empty, "no data:\n" + "\n".join(empty)
        assert not nan, "not a number:\n" + "\n".join(nan)
        # Every alert rule evaluates on these series without an error.
        def evaluated() -> bool:
            rules = [r for g in prom.get("/api/v1/rules")["groups"] for r in g["rules"]]
            assert len(rules) == len(MOVED)
            return all(r["health"] == "ok" for r in rules)
        prom.wait("a rule did not evaluate", evaluated, timeout=10)
    finally:
        prom.close()
