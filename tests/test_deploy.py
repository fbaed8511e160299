"""deploy/worker.yaml parses and keeps the promises deploy/README.md makes."""

from __future__ import annotations

from pathlib import Path

import yaml

from worker.config import CacheConfig, ServerConfig

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


def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next `--flag` (SMG's nargs='+' options)."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def test_smg_discovers_the_worker_pods_on_their_grpc_port() -> None:
    workers = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "worker.yaml").read_text()) if d}
    docs = [d for d in yaml.safe_load_all((DEPLOY / "smg.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}

    worker_pod = workers["Deployment"]["spec"]["template"]
    (wc,) = worker_pod["spec"]["containers"]
    worker_port = int(_arg(wc["args"], "--port", str(ServerConfig().port)))
    worker_block = int(_arg(wc["args"], "--block-size", str(CacheConfig().block_size)))

    pod = kinds["Deployment"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = c["args"]
    assert args[:2] == ["smg", "launch"] and "--service-discovery" in args
    selector = dict(kv.split("=", 1) for kv in _flag_values(args, "--selector"))
    assert selector and selector.items() <= worker_pod["metadata"]["labels"].items()
    assert int(_arg(args, "--service-discovery-port", "80")) == worker_port
    assert int(_arg(args, "--block-size", "16")) == worker_block
    assert _arg(args, "--policy", "") == "cache_aware"
    # Watch one namespace (its own): a namespaced Role is enough.
    assert _arg(args, "--service-discovery-namespace", "") == "$(POD_NAMESPACE)"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"

    (rule,) = kinds["Role"]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    binding = kinds["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": kinds["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": kinds["ServiceAccount"]["metadata"]["name"]}]
    assert pod["spec"]["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]

    http_port = int(_arg(args, "--port", "30000"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == http_port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ("http", http_port), probe
    svc = kinds["Service"]["spec"]
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["selector"] == kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["ports"][0]["targetPort"] in ("http", http_port)
