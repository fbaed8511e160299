"""Records (as `__main__` writes them) to the markdown of RELIABILITY.md."""

from __future__ import annotations

import json
from typing import Any

TITLES = {
    "storm": "Cancellation storm",
    "overload": "Overload with mixed priorities",
    "sigterm": "SIGTERM under load",
    "fault": "An injected model-step fault under load",
    "slow_reader": "Clients that stop reading",
    "deadline": "Deadlines that expire mid-generation",
    "soak": "Bounded soak",
}


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={json.dumps(v) if isinstance(v, dict | list) else v}"
                     for k, v in d.items())


def _table(rows: list[dict[str, Any]], first: str = "") -> list[str]:
    if not rows:
        return []
    cols = list(rows[0])
    out = ["| " + " | ".join([first] * bool(first) + cols) + " |",
           "|" + "---|" * (len(cols) + bool(first))]
    return out + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]


def render_one(rec: dict[str, Any]) -> str:
    env = rec["environment"]
    lines = [f"### {TITLES.get(rec['scenario'], rec['scenario'])}: "
             f"{'all checks held' if rec['ok'] else 'FAILED'}", "",
             f"{env['date']}; {env['machine']}; torch {env['torch'] or '-'}; commit "
             f"`{env['commit']}`; {rec['seconds']} s.", "",
             "```bash", env["command"], "```", "",
             f"Parameters: {_kv(rec['params'])}. Worker flags: "
             f"`{' '.join(rec['worker_flags']) or '(defaults)'}`.", ""]
    figures = dict(rec["figures"])
    windows = figures.pop("windows", None)
    by_priority = figures.pop("by_priority", None)
    lines += [f"Counts: {_kv(rec['counts'])}.", ""]
    if figures:
        lines += [f"Figures: {_kv(figures)}.", ""]
    if by_priority:
        lines += [*_table([{"priority": p, **v} for p, v in by_priority.items()]), ""]
    if windows:
        lines += [*_table(windows), ""]
    lines += ["| check | held | detail |", "|---|---|---|"]
    lines += [f"| {c['name']} | {'yes' if c['ok'] else '**no**'} | {c['detail']} |"
              for c in rec["checks"]]
    return "\n".join(lines) + "\n"


def render(records: list[dict[str, Any]]) -> str:
    return "\n".join(render_one(r) for r in records)
