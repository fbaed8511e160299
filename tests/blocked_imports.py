"""Run a module in a child Python where some packages cannot be imported, as on a machine
that never installed them: every `sys.meta_path` finder is wrapped so that it finds none of
them, before any of the program is imported (`importlib.util.find_spec` says None, `import`
raises ModuleNotFoundError)."""

from __future__ import annotations

import sys

# Packages that only the `test` or `bench` extras bring (pyproject.toml): the worker and the
# tools must start without them.
EXTRAS_ONLY = ("triton", "transformers", "accelerate", "matplotlib", "hypothesis", "pytest",
               "grpc_tools")

_PRELUDE = """
import runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Hiding:
    # Wraps each finder: a blocked name is not found anywhere, so find_spec() says None
    # and import raises ModuleNotFoundError, exactly as for a package never installed.
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(fullname, path, target)
    def __getattr__(self, name):
        return getattr(self.inner, name)
sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
module = sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def command(module: str, *args: str, blocked: tuple[str, ...] = EXTRAS_ONLY) -> list[str]:
    """argv that runs ``python -m module args...`` with `blocked` packages unimportable."""
    return [sys.executable, "-u", "-c", _PRELUDE, ",".join(blocked), module, *args]
