"""What a run needs beyond the core install, checked before it starts: a sweep's plot needs
matplotlib, ``--peer transformers`` needs transformers. Both come with the ``bench`` extra.
A missing one is said at start, not discovered after the measurements: an optional output
(the automatic sweep plot) is skipped with a note; one the command asks for by name
(``--plot``, ``--peer``) is a usage error before anything runs."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field

INSTALL = "pip install -e '.[bench]'"


@dataclass
class Extras:
    notes: list[str] = field(default_factory=list)  # what will be skipped
    errors: list[str] = field(default_factory=list)  # what is asked for and cannot be had
    can_plot: bool = True


def importable(module: str) -> bool:
    """Whether `module` imports here (a broken install counts as missing)."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or whatever a broken package raises on import
        return False
    return True


def check(args: argparse.Namespace) -> Extras:
    """What this run can do with the modules installed; each message names the extra."""
    ex = Extras()
    if len(args.request_rate) > 1 and not importable("matplotlib"):  # a sweep draws a plot
        ex.can_plot = False
        if args.plot:
            ex.errors.append(f"--plot needs matplotlib, which is not installed ({INSTALL})")
        else:
            ex.notes.append(f"no sweep plot: it needs matplotlib, which is not installed "
                            f"({INSTALL}); the results still go to the JSON file")
    if args.peer == "transformers" and not importable("transformers"):
        ex.errors.append(f"--peer transformers needs transformers, which is not installed "
                         f"({INSTALL})")
    return ex
