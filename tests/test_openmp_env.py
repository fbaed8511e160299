"""The CPU worker's OpenMP wait policy (worker.openmp_env): PASSIVE where the C kernels will
run, chosen before torch loads; never over the operator's choice, never for the torch path
or a CUDA device. The served default model logs it (tests/test_first_command.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker import openmp_env


@pytest.fixture
def fresh(monkeypatch):
    """As a CLI process before torch loads: this test process has torch already."""
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(openmp_env, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "sse2"})
    monkeypatch.setattr(openmp_env.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_passive_where_the_c_kernels_will_run(fresh) -> None:
    env: dict[str, str] = {}
    assert openmp_env.set_default_wait_policy("auto", "auto", env) == "PASSIVE"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {}
    assert openmp_env.set_default_wait_policy("c", "cpu", env) == "PASSIVE"


@pytest.mark.parametrize("kernels, device", [("torch", "auto"), ("auto", "cuda"), ("c", "cuda:1"),
                                             ("torch", "cpu")])
def test_left_alone_for_the_torch_path_and_cuda(fresh, kernels, device) -> None:
    env: dict[str, str] = {}
    assert openmp_env.set_default_wait_policy(kernels, device, env) is None
    assert env == {}


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "30000"}])
def test_the_operators_choice_stands(fresh, chosen) -> None:
    env = dict(chosen)
    assert openmp_env.set_default_wait_policy("auto", "auto", env) is None
    assert env == chosen


def test_left_alone_without_the_isa_or_a_compiler(fresh, monkeypatch) -> None:
    monkeypatch.setattr(openmp_env, "_cpu_flags", lambda: {"avx", "sse2"})  # no AVX2
    assert openmp_env.set_default_wait_policy("auto", "auto", {}) is None
    monkeypatch.setattr(openmp_env, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(openmp_env.shutil, "which", lambda name: None)
    assert openmp_env.set_default_wait_policy("auto", "auto", {}) is None


def test_too_late_once_torch_has_loaded() -> None:
    assert "torch" in sys.modules  # pytest's process: libgomp has read its settings
    env: dict[str, str] = {}
    assert openmp_env.set_default_wait_policy("auto", "auto", env) is None and env == {}


def test_the_cli_sets_it_before_torch_loads() -> None:
    """`llm-worker generate` (and serve) choose before their first torch import: the child's
    libgomp sees PASSIVE (read back from the environment torch's process has)."""
    code = ("import os, sys\n"
            "from worker import cli, openmp_env\n"
            "seen = {}\n"
            "def fake(args):\n"
            "    import torch  # noqa: F401  (what _generate does first)\n"
            "    seen['policy'] = os.environ.get('OMP_WAIT_POLICY')\n"
            "    return 0\n"
            "cli._generate = fake\n"
            "assert cli.main(['generate', 'hi']) == 0\n"
            "print(seen['policy'], openmp_env.c_kernels_will_run('auto', 'auto'))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    policy, will_run = out.stdout.split()
    assert policy == ("PASSIVE" if will_run == "True" else "None")
