"""No code execution from data: nothing in the shipped packages may unpickle.

Scans the code tokens (not comments, not strings: `tokenize`) of every .py file under the
packages for pickle and its relatives, `torch.load`, `joblib.load` and
``allow_pickle=True``. Weights come only from safetensors or GGUF.
"""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("worker", "scheduler", "kvcache", "ops", "clients")
BANNED_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
BANNED_CALLS = {("torch", "load"), ("joblib", "load")}  # NAME . NAME


def violations(source: str) -> list[str]:
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    found = []
    for i, t in enumerate(toks):
        nxt = toks[i + 1:i + 4]
        where = f"line {t.start[0]}"
        if t.type == tokenize.NAME and t.string in BANNED_NAMES:
            found.append(f"{where}: {t.string}")
        elif (t.type == tokenize.NAME and len(nxt) >= 2 and nxt[0].string == "."
              and (t.string, nxt[1].string) in BANNED_CALLS):
            found.append(f"{where}: {t.string}.{nxt[1].string}")
        elif (t.string == "allow_pickle" and len(nxt) >= 2 and nxt[0].string == "="
              and nxt[1].string != "False"):
            found.append(f"{where}: allow_pickle={nxt[1].string}")
    return found


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_the_scanner_catches_what_it_must_and_ignores_comments_and_strings() -> None:
    bad = ("import pickle\n"
           "from dill import loads\n"
           "w = torch.load(path)\n"
           "x = joblib .load(f)\n"
           "y = numpy.load(f, allow_pickle=True)\n")
    assert len(violations(bad)) == 5
    ok = ('"""Nothing is ever unpickled; no pickle, no torch.load."""\n'
          "# pickle torch.load allow_pickle=True\n"
          "msg = 'pickled weights are never loaded (torch.load)'\n"
          "z = numpy.load(f, allow_pickle=False)\n"
          "w = safetensors.torch.load_file(path)\n")
    assert violations(ok) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_pickle_in_the_code(pkg: str) -> None:
    files = [p for p in _files() if p.relative_to(ROOT).parts[0] == pkg]
    assert files, f"no .py files under {pkg}/"
    bad = {str(p.relative_to(ROOT)): v for p in files if (v := violations(p.read_text("utf-8")))}
    assert not bad, f"code that can execute data (pickle and kin): {bad}"
