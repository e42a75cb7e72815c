"""What the arfuse configuration adds to vLLM's compile cache key, so that vLLM's compile cache
never hands a graph compiled without arfuse to a run with it, or back (VllmConfig.compute_hash up
to vLLM 0.33, VllmConfig.compile_factors from 0.34; arfuse.vllm.plugin installs the hook)."""

from __future__ import annotations

import hashlib
from typing import Any

from . import settings as _settings

# Computed once per process, before the hook is installed (compute()).
_key: str | None = None


def compute() -> str:
    """Computes this process's key (once, before the hook is installed) and returns it."""
    global _key
    _key = key()
    return _key


def key() -> str:
    """What the arfuse configuration contributes to vLLM's compile cache key."""
    import arfuse

    parts = [
        str(getattr(arfuse, "__version__", "unknown")),
        _settings.source_hash(),
        repr(sorted(_settings.from_env().as_dict().items())),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _mix_hash(base: str) -> str:
    assert _key is not None
    return hashlib.sha256(f"{base}|arfuse|{_key}".encode()).hexdigest()[: len(base)]


def after_compute_hash(config: Any, base: str, args: Any, kwargs: Any) -> str:
    """The VllmConfig.compute_hash hook (vLLM up to 0.33): vLLM's hash mixed with the key."""
    return _mix_hash(base)


def after_compile_factors(config: Any, factors: Any, args: Any, kwargs: Any) -> Any:
    """The VllmConfig.compile_factors hook (vLLM 0.34+): vLLM's factors plus the key."""
    return {**factors, "arfuse": _key}
