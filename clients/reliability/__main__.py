"""``python -m clients.reliability run NAME [NAME ...] [--scale S] [--out FILE]`` runs
scenarios and writes their records as JSON; ``... report FILE ...`` prints them as the
markdown of RELIABILITY.md. ``--set name.param=value`` overrides one parameter."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from clients.reliability.report import render
from clients.reliability.scenarios import SCENARIOS


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.reliability", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run scenarios against fresh worker processes")
    run.add_argument("names", nargs="+", choices=[*SCENARIOS, "all"])
    run.add_argument("--set", action="append", default=[], metavar="SCENARIO.PARAM=VALUE",
                     help="override a scenario parameter, e.g. storm.n=100 or soak.duration_s=60")
    run.add_argument("--out", type=Path, help="write the records here (JSON list)")
    rep = sub.add_parser("report", help="render records as markdown")
    rep.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)

    if args.cmd == "report":
        records = [r for f in args.files for r in json.loads(f.read_text())]
        print(render(records))
        return 0
    names = list(SCENARIOS) if "all" in args.names else args.names
    overrides: dict[str, dict[str, Any]] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        scen, _, param = key.partition(".")
        if scen not in SCENARIOS or not param:
            ap.error(f"--set {item!r}: expected SCENARIO.PARAM=VALUE")
        overrides.setdefault(scen, {})[param] = _value(value)
    out: list[dict[str, Any]] = []
    for name in names:
        t = time.monotonic()
        rec = asyncio.run(SCENARIOS[name](**overrides.get(name, {})))
        out.append(rec.to_json(time.monotonic() - t))
        verdict = "ok" if rec.ok else "FAILED: " + "; ".join(rec.failed())
        print(f"{name}: {verdict} ({time.monotonic() - t:.0f}s)", file=sys.stderr)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
    return 0 if all(r["ok"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
