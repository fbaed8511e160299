"""The records behind BENCHMARKS.md and RELIABILITY.md: every `bench-results/...` file they
name is in the tree (a line that says "not kept" names a file that is known to be gone), and
no doc or result file carries a machine's absolute path (commands run from the repo root)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("BENCHMARKS.md", "RELIABILITY.md")
PATH = re.compile(r"bench-results/[A-Za-z0-9_.*{},$/-]*[A-Za-z0-9_*}/]")
MACHINE_DIRS = re.compile(r"(?<![\w.])/(?:work|root|tmp|home)/")


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every bench-results path on a line not marked "not kept"."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1)
            if "not kept" not in line for m in PATH.finditer(line)]


def expand(path: str) -> list[str]:
    """Shell braces ({a,b}) expanded; $VAR and * become globs."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return [re.sub(r"\$\{?\w+\}?", "*", "".join(c)) for c in itertools.product(*choices)]


def test_the_extraction_sees_what_it_should() -> None:
    text = ("see `bench-results/a.json`, and bench-results/b-$S-r2.json.\n"
            "x --output-json bench-results/gone.json  # not kept\n"
            "copied to `bench-results/x-b{12,16}-s0.json`; logs in `bench-results/issue7*.log`")
    assert named_paths(text) == [(1, "bench-results/a.json"), (1, "bench-results/b-$S-r2.json"),
                                 (3, "bench-results/x-b{12,16}-s0.json"),
                                 (3, "bench-results/issue7*.log")]
    assert expand("bench-results/x-b{12,16}-s$S.json") == ["bench-results/x-b12-s*.json",
                                                         "bench-results/x-b16-s*.json"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_result_file_a_doc_names_exists(doc: str) -> None:
    named = named_paths((ROOT / doc).read_text(encoding="utf-8"))
    assert named, f"{doc} names no bench-results file"
    missing = [f"{doc}:{n}: {p}" for n, p in named for pattern in expand(p)
               if not any(ROOT.glob(pattern.rstrip("/")))]
    assert not missing, "named but not in the tree:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", [*DOCS, "README.md"])
def test_docs_carry_no_machine_paths(doc: str) -> None:
    bad = [f"{doc}:{n}: {line.strip()[:160]}"
           for n, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1)
           if MACHINE_DIRS.search(line)]
    assert not bad, "absolute machine paths (write commands relative to the repo root):\n" + \
        "\n".join(bad)


def test_result_files_carry_no_machine_paths() -> None:
    files = sorted((ROOT / "bench-results").rglob("*.json"))
    assert files, "no result files in the tree"
    bad = []
    for f in files:
        def strings(x: object) -> list[str]:
            if isinstance(x, str):
                return [x]
            if isinstance(x, dict):
                return [s for v in x.values() for s in strings(v)]
            if isinstance(x, list):
                return [s for v in x for s in strings(v)]
            return []

        bad += [f"{f.relative_to(ROOT)}: {s[:160]}"
                for s in strings(json.loads(f.read_text(encoding="utf-8")))
                if MACHINE_DIRS.search(s)]
    assert not bad, "absolute machine paths in result files:\n" + "\n".join(bad)
