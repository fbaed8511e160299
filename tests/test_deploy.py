"""deploy/worker.yaml parses and keeps the promises deploy/README.md makes."""

from __future__ import annotations

from pathlib import Path

import yaml

from worker.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def test_manifests_parse_and_the_grace_period_outlasts_the_drain() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "worker.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service"}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:4] == ["llm-worker", "serve", "--host", "0.0.0.0"]
    port = int(_arg(c["args"], "--port", str(ServerConfig().port)))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
    drain = float(_arg(c["args"], "--drain-grace-s", str(ServerConfig().drain_grace_s)))
    pre_stop = c["lifecycle"]["preStop"]
    sleep_s = (pre_stop["sleep"]["seconds"] if "sleep" in pre_stop
               else float(pre_stop["exec"]["command"][-1].split()[-1]))
    assert pod["terminationGracePeriodSeconds"] > sleep_s + drain + 5
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > drain  # not killed mid-drain
    assert c["resources"]["requests"]
    svc = kinds["Service"]["spec"]
    assert svc["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["ports"][0]["port"] == port
