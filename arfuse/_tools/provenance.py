"""Where a tool's results come from: the commit, the library, the versions, the date, the
command. One place for ``arfuse.bench`` and ``arfuse.check``."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path


def git_commit() -> str | None:
    """$ARFUSE_COMMIT if set (a tree copied without its .git, e.g. to a GPU machine, names its
    commit that way), else ``git rev-parse HEAD`` of the package's checkout, else None."""
    if os.environ.get("ARFUSE_COMMIT"):
        return os.environ["ARFUSE_COMMIT"]
    out = command_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent)
    return out or None


def command_output(args: list[str], *, cwd=None, timeout: float = 20) -> str | None:
    """stdout of a command (stripped), or None when it is missing or fails."""
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_info(command: str | None = None) -> dict:
    """The fields every report carries: date (UTC), host, Python, torch, CUDA, arfuse's commit
    and version, the op library and manifest loaded and their API version, the command."""
    import torch

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "arfuse_commit": git_commit(),
        "command": command if command is not None else " ".join(sys.argv),
    }
    try:
        import arfuse
        from arfuse import _lib
        info["arfuse_version"] = getattr(arfuse, "__version__", None)
        info["library"] = _lib.library_path()
        info["manifest"] = _lib.manifest_path()
        info["library_api_version"] = _lib._manifest_api_version()
    except Exception as e:  # the report still says what ran
        info["library"] = f"unavailable: {type(e).__name__}: {e}"
    return info
