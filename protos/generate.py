"""Regenerate the Python stubs beside the .proto files:

    python protos/generate.py

The stubs are checked in (package `llmworker`, mapped to protos/llmworker), so
clients need no protoc; tests/test_protos.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = sorted(p.relative_to(HERE).as_posix() for p in HERE.rglob("*.proto"))


def generate(out_dir: Path = HERE) -> None:
    from grpc_tools import protoc

    for proto in PROTOS:
        args = ["grpc_tools.protoc", f"-I{HERE}", f"--python_out={out_dir}",
                f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", proto]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
