"""``llm-worker-bench report RESULT.json ...``: markdown for BENCHMARKS.md from result files,
so no figure is ever typed by hand.

Per file: a heading, where and how it was measured (date, machine, CPU, commit, command),
one table row per run (rate, requests, throughputs, TTFT/TPOT/ITL/E2EL figures, goodput),
then the knee of a sweep, the peer comparison and the plot, when the file has them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def _meta(result: dict[str, Any]) -> list[str]:
    env, server = result.get("environment", {}), result.get("server", {})
    commit = env.get("git_commit") or "?"
    dirty = " (uncommitted changes)" if env.get("git_dirty") else ""
    return [
        f"- date: {env.get('date', '?')}; machine: {env.get('machine', '?')} "
        f"({env.get('platform', '?')}), CPU: {env.get('cpu', '?')} x{env.get('cpu_count', '?')}"
        f"; torch {env.get('torch', '?')}",
        f"- commit: `{commit[:12]}`{dirty}",
        f"- server: {server.get('backend', '?')} "
        f"{server.get('target') or server.get('base_url') or ''}, model "
        f"{server.get('model', '?')} ({server.get('device', '?')}, {server.get('dtype', '?')})",
        f"- workload: {json.dumps(result.get('dataset', {}), sort_keys=True)}",
        f"- command: `{env.get('command', '?')}`",
    ]


HEADER = (
    "| rate (req/s) | conc. | done / failed | req/s | in tok/s | out tok/s "
    "| TTFT mean / p50 / p99 (ms) | TPOT mean / p99 (ms) | ITL p50 / p99 (ms) "
    "| E2EL p50 / p99 (ms) | goodput (req/s) |"
)


def _row(run: dict[str, Any]) -> str:
    s = run["summary"]
    t, p, i, e = s["ttft_ms"], s["tpot_ms"], s["itl_ms"], s["e2el_ms"]
    good = _f(s.get("request_goodput"), 2) if "request_goodput" in s else "–"
    return (
        f"| {run['request_rate']} | {run['max_concurrency'] or '–'} "
        f"| {s['completed']} / {s['failed']} | {_f(s['request_throughput'], 2)} "
        f"| {_f(s['input_throughput'])} | {_f(s['output_throughput'])} "
        f"| {_f(t['mean'])} / {_f(t['median'])} / {_f(t['p99'])} "
        f"| {_f(p['mean'])} / {_f(p['p99'])} | {_f(i['median'])} / {_f(i['p99'])} "
        f"| {_f(e['median'])} / {_f(e['p99'])} | {good} |"
    )


def render(result: dict[str, Any], name: str) -> str:
    lines = [f"### {name}", "", *_meta(result), ""]
    lines += [HEADER, _sep()]
    lines += [_row(run) for run in result["runs"]]
    for run in result["runs"]:
        if by_kind := run["summary"].get("by_kind"):
            lines += ["", f"By kind, rate {run['request_rate']} req/s:", "",
                      "| kind | done / failed | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) "
                      "| ITL p50 / p99 (ms) | E2EL p50 / p99 (ms) |", "|---|---|---|---|---|---|"]
            for kind, k in by_kind.items():
                lines.append(
                    f"| {kind} | {k['completed']} / {k['failed']} | "
                    + " | ".join(f"{_f(k[m]['median'])} / {_f(k[m]['p99'])}"
                                 for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")) + " |"
                )
    slo = next((r["summary"].get("slo_ms") for r in result["runs"] if "slo_ms" in r["summary"]),
               None)
    if slo:
        lines += ["", "Goodput SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items())]
    if knee := result.get("knee"):
        where = (f"{knee['request_rate']} req/s, {_f(knee['output_throughput'])} output tok/s, "
                 f"p99 TTFT {_f(knee['p99_ttft_ms'])} ms")
        tail = "" if knee["reached"] else " (not reached: the highest rate swept)"
        lines += ["", f"Knee ({knee['definition']}): {where}{tail}."]
    if peer := result.get("peer"):
        lines += [
            "",
            f"Peer: {peer['system']}, batch {peer['batch_size']}, {peer['threads']} threads: "
            f"{_f(peer['output_throughput'])} output tok/s ({peer['output_tokens']} tokens in "
            f"{_f(peer['wall_s'], 2)} s); ours {_f(peer['ours_output_throughput'])}: "
            f"**{peer['ratio']:.2f}x**.",
        ]
    if plot := result.get("plot"):
        lines += ["", f"![{name}]({plot})"]
    return "\n".join(lines) + "\n"


def _sep() -> str:
    return "|" + "---|" * (HEADER.count("|") - 1)


def render_files(paths: list[Path]) -> str:
    parts = []
    for p in paths:
        result = json.loads(p.read_text())
        parts.append(render(result, result.get("name") or p.stem))
    return "\n".join(parts)


def render_comparison(base_path: Path, new_path: Path) -> str:
    """Run by run (same rates, in order), `new` against `base`: output throughput and the
    p99 latencies, with base/new ratios for latencies (higher = new is better) and new/base
    for throughput."""
    base, new = (json.loads(p.read_text()) for p in (base_path, new_path))
    bname, nname = (r.get("name") or p.stem for r, p in ((base, base_path), (new, new_path)))
    lines = [f"**{nname}** against **{bname}**:", "",
             "| rate (req/s) | out tok/s base → new (new/base) | ITL p99 ms (base/new) "
             "| TPOT p99 ms (base/new) | TTFT p99 ms (base/new) |", "|---|---|---|---|---|"]
    for b, n in zip(base["runs"], new["runs"], strict=True):
        assert b["request_rate"] == n["request_rate"], "compare runs made at the same rates"
        bs, ns = b["summary"], n["summary"]

        def lat(key: str, bs: dict = bs, ns: dict = ns) -> str:
            x, y = bs[key]["p99"], ns[key]["p99"]
            return f"{_f(x)} → {_f(y)} ({x / y:.2f}x)" if x and y else "–"

        out = f"{_f(bs['output_throughput'])} → {_f(ns['output_throughput'])} " \
              f"({ns['output_throughput'] / bs['output_throughput']:.2f}x)"
        lines.append(f"| {_f(b['request_rate'])} | {out} | {lat('itl_ms')} | {lat('tpot_ms')} "
                     f"| {lat('ttft_ms')} |")
    return "\n".join(lines) + "\n"
