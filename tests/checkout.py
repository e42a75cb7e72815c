"""Where the tests' subprocesses take arfuse from: this checkout, or the installed wheel.

make test installs the wheel it built and runs the suite from a folder outside the checkout with
ARFUSE_TEST_INSTALLED=1 (tests/conftest.py): then no subprocess may find the checkout's package
first, neither through PYTHONPATH nor through its working directory. Run from the checkout
(`pytest tests` at its root), the subprocesses get the checkout on PYTHONPATH as before.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = os.environ.get("ARFUSE_TEST_INSTALLED") == "1"


def pythonpath(env: dict[str, str]) -> dict[str, str]:
    """`env` with the checkout first on PYTHONPATH, unless the installed wheel is under test."""
    env = dict(env)
    if not INSTALLED:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")]
                                                           if p])
    return env


def cwd() -> str:
    """A working directory for `python -m arfuse...` subprocesses: the checkout's root (where its
    package is importable), or, with the installed wheel under test, a folder outside it."""
    return tempfile.gettempdir() if INSTALLED else str(ROOT)
