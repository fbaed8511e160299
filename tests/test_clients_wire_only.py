"""`clients/` speaks the wire only: no module of it imports the engine's packages, at the top
or lazily inside a function, nor `benchmarks/` (which does). The same check a reader runs:

    grep -rnE "^\\s*(from|import) (worker|scheduler|kvcache|ops)\\b" clients/
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = ROOT / "clients"
FORBIDDEN = {"worker", "scheduler", "kvcache", "ops", "benchmarks", "tests"}
FILES = sorted(CLIENTS.rglob("*.py"))


def engine_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import of a FORBIDDEN package in `source`: import statements
    anywhere (functions included) and importlib.import_module / __import__ of a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module",
                                             "__import__")):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if n.split(".")[0] in FORBIDDEN]
    return sorted(found)


def test_the_check_finds_what_it_claims_to() -> None:
    src = ("import os\nfrom clients.bench import dataset\nimport worker.engine\n"
           "def f():\n    from scheduler.request import SamplingParams\n"
           "    import importlib\n    importlib.import_module('ops.linear')\n"
           "from opsx import y\nimport kvcache as k\n")
    assert engine_imports(src) == [(3, "worker.engine"), (5, "scheduler.request"),
                                   (7, "ops.linear"), (9, "kvcache")]


def test_there_are_client_modules_to_check() -> None:
    names = {p.relative_to(CLIENTS).as_posix() for p in FILES}
    assert {"client.py", "cli.py", "bench/cli.py", "reliability/scenarios.py"} <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_client_module_imports_nothing_of_the_engine(path: Path) -> None:
    bad = engine_imports(path.read_text(encoding="utf-8"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: clients/ speaks the wire only"
