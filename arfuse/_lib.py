"""Locating and loading the compiled torch extension (libarfuse_ops.so), and the errors it raises.

The library registers the `torch.ops.arfuse.*` ops (schemas, CUDA and composite kernels) on the
PyTorch stable ABI, so one build loads under torch 2.11 and later releases. It is found at
$ARFUSE_LIBRARY if set (the test suite points it at the CI-matrix build), else in the package's
`_lib/` folder (where `make` and the wheel put it).

Errors: the stable ABI turns every error of the library into a RuntimeError; the library puts
the kind first in the message ("ValueError: arfuse: residual: want [T, H], got [3]";
csrc/host/errors.h). The public API catches them and re-raises (`reraise`) those
as ValueError / TypeError with the rest of the message. A direct torch.ops.arfuse.* call raises
the RuntimeError.
"""

from __future__ import annotations

import os
import re
import threading

# The device API version (ARFUSE_DEVICE_API_VERSION, csrc/arfuse/vocab.h; both generated from
# gen/tables.go) this Python code speaks; a library whose manifest says otherwise is stale
# (rebuild with make).
from ._vocab_tables import API_VERSION

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_loaded: str | None = None
_error: str | None = None


def library_path() -> str:
    return os.environ.get("ARFUSE_LIBRARY") or os.path.join(_PKG_DIR, "_lib", "libarfuse_ops.so")


def manifest_path() -> str:
    env = os.environ.get("ARFUSE_MANIFEST")
    if env:
        return env
    return os.path.join(os.path.dirname(library_path()), "manifest.json")


def load() -> bool:
    """Loads the library once; returns whether it is loaded. Never raises."""
    global _loaded, _error
    if _loaded is not None:  # every op call asks: no lock once loaded
        return True
    with _lock:
        if _loaded is not None:
            return True
        path = library_path()
        if not os.path.exists(path):
            _error = f"{path} does not exist: build it with `make` (or set ARFUSE_LIBRARY)"
            return False
        built_for = _manifest_api_version()
        if built_for is not None and built_for != API_VERSION:
            _error = (f"{path} was built for device API version {built_for}, this package "
                      f"speaks {API_VERSION}: rebuild it with `make`")
            return False
        import torch

        try:
            torch.ops.load_library(path)
        except OSError as e:  # a broken or foreign build: say so instead of failing on first use
            _error = f"loading {path} failed: {e}"
            return False
        try:
            from . import _cpu, _fake

            _fake.register()
            _cpu.register()
        except RuntimeError as e:  # e.g. a foreign build that registers its own Meta kernels
            _error = f"{path} does not match this package ({e}): rebuild it with `make`"
            return False
        _loaded = path
        _error = None
    return True


def _manifest_api_version():
    import json

    try:
        with open(manifest_path()) as f:
            return int(json.load(f)["api_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_error() -> str | None:
    """Why the library did not load (None once it has)."""
    return _error


def is_built() -> bool:
    """Whether the compiled library is present and loaded."""
    return load()


def require() -> None:
    """Raises a clear error if the library cannot be used."""
    if not load():
        raise RuntimeError(f"arfuse: the compiled library is not available: {_error}")


_KIND = re.compile(r"(ValueError|TypeError): (arfuse: [^\n]*)")
_KINDS = {"ValueError": ValueError, "TypeError": TypeError}


def typed(error: RuntimeError) -> Exception:
    """The ValueError / TypeError a library error stands for (csrc/host/errors.h), or the error
    itself when its message names no such kind."""
    m = _KIND.search(str(error))
    if m is None:
        return error
    return _KINDS[m.group(1)](m.group(2))


def reraise(error: RuntimeError):
    """Raises what `error` stands for: `except RuntimeError as e: _lib.reraise(e)` around an op
    call (free when nothing is raised)."""
    t = typed(error)
    if t is error:
        raise error
    raise t from None
