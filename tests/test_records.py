"""The records behind BENCHMARKS.md and RELIABILITY.md: every `bench-results/...` file they
name is in the tree (a line that says "not kept" names a file that is known to be gone), no
doc or result file carries a machine's absolute path (commands run from the repo root), and
every figure the two reports give is a value of the JSON record of the run its row names,
whose date and commit the run's row gives."""

from __future__ import annotations

import itertools
import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("BENCHMARKS.md", "RELIABILITY.md", "bench-results/history/BENCHMARKS.md", "bench-results/history/RELIABILITY.md")
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


# ---- every figure in the reports traced to its run's JSON record ----------------------------
#
# A report's tables are of three kinds: figures (the last column `run` names one or more runs),
# runs (`| run | date | machine | commit | command | record |`), and the machines (`| machine |
# ...`); RELIABILITY.md's findings (`| found | ...`) describe bugs. Every number in a figure's
# cells (all but the first and the run column) must be a value of its runs' records: a number
# of the JSON, or the median, p10, p90, mean, fastest or slowest of one of its lists of numbers
# (or of the same field over a list of rounds), to the digits shown, as it is or scaled by 1000,
# 1/1000 or 100 (ms and s, percentages). A run's date and commit must be its records'.

FIGURE_DOCS = DOCS[:2]
RUNS_HEADER = ["run", "date", "machine", "commit", "command", "record"]
DESCRIPTIVE = ("machine", "found")
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?(?![\d.]|[a-wyz])")
UNIT_IN_PROSE = re.compile(r"(?<![\w.-])\d+(?:\.\d+)?(?:x\b| ?(?:ms|tok/s|GB/s)\b)")
RECORD = re.compile(r"\]\((bench-results/[^)\s]+\.json)\)")
SCALES = (1.0, 1e3, 1e-3, 100.0)


def tables(text: str) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """(line number, header cells, [(line number, cells)]) of each markdown table."""
    out, lines, i = [], text.splitlines(), 0
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            head, start, rows = split(lines[i]), i + 1, []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append((i + 1, split(lines[i])))
                i += 1
            out.append((start, head, rows))
        else:
            i += 1
    return out


def numbers(cell: str) -> list[str]:
    return NUMBER.findall(re.sub(r"`[^`]*`", "", cell))


def matches(text: str, values: set[float]) -> bool:
    mantissa, _, exp = text.replace(",", "").partition("e")
    digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
    want = float(text.replace(",", ""))
    tol = 0.5 * 10.0 ** (int(exp or 0) - digits) * (1 + 1e-9)
    return any(abs(v * s - want) <= tol for v in values for s in SCALES)


def record_values(obj: object) -> set[float]:
    values: set[float] = set()
    fields: dict[tuple, list[float]] = {}

    def summary(xs: list[float]) -> list[float]:
        s, n = sorted(xs), len(xs)
        return [statistics.median(s), s[0], s[-1], statistics.fmean(s), s[n // 10], s[min(n - 1, 9 * n // 10)]]

    def walk(x: object, path: tuple) -> None:
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, int | float):
            values.add(float(x))
            fields.setdefault(path, []).append(float(x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*path, str(k)))
        elif isinstance(x, list):
            nums = [float(v) for v in x if isinstance(v, int | float) and not isinstance(v, bool)]
            if nums and len(nums) == len(x):  # samples: their summary, not each one
                values.update(summary(nums))
                fields.setdefault((*path, "*"), []).extend(nums)
            else:
                for v in x:
                    walk(v, (*path, "*"))

    walk(obj, ())
    for xs in fields.values():
        if len(xs) > 1:
            values.update(summary(xs))
    return values


def record_meta(obj: object) -> tuple[set[str], set[str]]:
    """The dates (YYYY-MM-DD) and commits a record carries, wherever it keeps them."""
    dates, commits = set(), set()

    def walk(x: object) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "date" and isinstance(v, str):
                    dates.add(v[:10])
                elif k in ("git_commit", "commit") and isinstance(v, str) and re.match(r"[0-9a-f]{7}", v):
                    commits.add(v[:7])
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(obj)
    return dates, commits


def report_tables(doc: str):
    text = (ROOT / doc).read_text(encoding="utf-8")
    runs, figures, machines, other = {}, [], set(), []
    for start, head, rows in tables(text):
        low = [h.lower() for h in head]
        if low == RUNS_HEADER:
            for n, cells in rows:
                assert cells[0] not in runs, f"{doc}:{n}: run {cells[0]} defined twice"
                runs[cells[0]] = (n, dict(zip(RUNS_HEADER, cells, strict=True)))
        elif low[-1] == "run":
            figures += [(n, head, cells) for n, cells in rows]
        elif low[0] == "machine":
            machines |= {cells[0] for _, cells in rows}
        elif low[0] not in DESCRIPTIVE:
            other.append(f"{doc}:{start}: {' | '.join(head)[:120]}")
    return text, runs, figures, machines, other


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_every_table_is_figures_runs_or_machines(doc: str) -> None:
    _, runs, figures, _, other = report_tables(doc)
    assert not other, "tables whose figures name no run:\n" + "\n".join(other)
    assert figures and runs, f"{doc} has no figure with its run"


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_every_run_has_date_machine_commit_command_and_its_records(doc: str) -> None:
    _, runs, figures, machines, _ = report_tables(doc)
    machines |= {m for d in FIGURE_DOCS if d != doc for m in report_tables(d)[3]}
    bad = []
    used = {r.strip() for _, _, cells in figures for r in cells[-1].split(",")}
    for name, (n, run) in runs.items():
        where = f"{doc}:{n}: run {name}"
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]):
            bad.append(f"{where}: date {run['date']!r}")
        if run["machine"] not in machines:
            bad.append(f"{where}: machine {run['machine']!r} is not in the machines table")
        if not re.search(r"`[0-9a-f]{7,}`", run["commit"]):
            bad.append(f"{where}: no commit")
        if "`" not in run["command"]:
            bad.append(f"{where}: no command")
        records = RECORD.findall(run["record"])
        if not records:
            bad.append(f"{where}: no JSON record linked")
        for rec in records:
            if not (ROOT / rec).is_file():
                bad.append(f"{where}: {rec} is not in the tree")
                continue
            dates, commits = record_meta(json.loads((ROOT / rec).read_text(encoding="utf-8")))
            if run["date"] not in dates:
                bad.append(f"{where}: date {run['date']} is not its record's ({', '.join(sorted(dates)) or 'none'}): {rec}")
            if not any(c in run["commit"] for c in commits):
                bad.append(f"{where}: commit cell names none of its record's ({', '.join(sorted(commits)) or 'none'}): {rec}")
        if name not in used:
            bad.append(f"{where}: no figure names it")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_every_figure_is_in_its_runs_records(doc: str) -> None:
    _, runs, figures, _, _ = report_tables(doc)
    cache: dict[str, set[float]] = {}
    bad = []
    for n, head, cells in figures:
        names = [r.strip() for r in cells[-1].split(",")]
        unknown = [r for r in names if r not in runs]
        if unknown:
            bad.append(f"{doc}:{n}: unknown run {', '.join(unknown)}")
            continue
        values: set[float] = set()
        for r in names:
            for rec in RECORD.findall(runs[r][1]["record"]):
                if not (ROOT / rec).is_file():  # the runs' test names it
                    continue
                if rec not in cache:
                    cache[rec] = record_values(json.loads((ROOT / rec).read_text(encoding="utf-8")))
                values |= cache[rec]
        cells_with_figures = [c for h, c in zip(head[1:-1], cells[1:-1], strict=True) if h.lower() != "target"]
        found = [x for c in cells_with_figures for x in numbers(c)]
        if not found:
            bad.append(f"{doc}:{n}: a row with no figure: {cells[0][:80]}")
        bad += [f"{doc}:{n}: {x} is not in the records of {', '.join(names)} ({cells[0][:70]})"
                for x in found if not matches(x, values)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", FIGURE_DOCS)
def test_figures_live_in_tables_not_in_prose(doc: str) -> None:
    """A measured ratio, time or rate belongs in a figure's row (with its run), not in a
    sentence where no test can trace it."""
    bad, fenced = [], False
    for n, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
        fenced ^= line.startswith("```")
        if fenced or line.startswith(("|", "```")):
            continue
        bad += [f"{doc}:{n}: {m.group(0)!r} in {line.strip()[:100]}"
                for m in UNIT_IN_PROSE.finditer(re.sub(r"`[^`]*`", "", line))]
    assert not bad, "figures outside a table:\n" + "\n".join(bad)


def test_the_figure_checks_see_what_they_should() -> None:
    values = record_values({"rounds": [{"a": {"ms": [1.0, 2.0, 9.0]}}, {"a": {"ms": [3.0]}}],
                            "ratio": 1.0464, "ttft_ms": 1931.1, "acceptance": 0.7535})
    for text in ("2.0", "3", "1.05", "1.93", "75", "9", "2.5"):  # median, pooled median, ratio, s, %, max
        assert matches(text, values), text
    for text in ("2.1", "1.04", "5"):
        assert not matches(text, values), text
    assert matches("4.5e-04", {0.00045490}) and not matches("4.6e-04", {0.00045490})
    assert numbers("256.1 vs 418.5 (1.63x); 16,999.7, 75%, 3.2e-02, 1.41x, 1.46x `--rounds 3`") == [
        "256.1", "418.5", "1.63", "16,999.7", "75", "3.2e-02", "1.41", "1.46"]
    assert record_meta({"environment": {"date": "2026-11-29T05:17:01+00:00", "git_commit": "ad9b1ea87b"}}) == (
        {"2026-11-29"}, {"ad9b1ea"})
