"""Keeps a failure of arfuse's own code from stopping vLLM.

Every function arfuse installs into vLLM goes through `after_hook`: vLLM's original runs first and
its exceptions propagate unchanged; what arfuse does afterwards runs inside a try, and any
exception there switches the whole integration off in this process (`disable`: one log line with
the reason) and returns the original's result untouched. The fusion pass goes into vLLM's pass
list wrapped in arfuse.vllm.guarded_pass.GuardedPass, which restores the graph it was given when the pass raises.
Once disabled, every hook passes straight through and every GuardedPass leaves graphs alone, so
the compile cache key, the pass list and the graphs stay consistent (all without arfuse).

The one log line is an ERROR that says fusion is OFF and why. With ARFUSE_VLLM=strict, `disable`
raises FusionOff instead of returning, and every guard lets FusionOff through: vLLM then stops at
start-up rather than serve unfused.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

# Under "vllm" so that vLLM's logging configuration (format, level) applies.
logger = logging.getLogger("vllm.arfuse")

MARK = "__arfuse_vllm_hook__"
_lock = threading.Lock()
_disabled: str | None = None


class FusionOff(RuntimeError):
    """ARFUSE_VLLM=strict and the integration cannot run: raised through vLLM on purpose."""


def active() -> bool:
    """False once something in arfuse's integration failed in this process."""
    return _disabled is None


def disabled_reason() -> str | None:
    return _disabled


def disable(reason: str) -> None:
    """Switches the integration off in this process; logs the first reason (one ERROR line).
    With ARFUSE_VLLM=strict it raises FusionOff (every time: the first reason, then this one)."""
    global _disabled
    with _lock:
        first = _disabled is None
        if first:
            _disabled = reason
    if first:
        logger.error("arfuse: fusion is OFF in this process: %s", reason)
    if _strict():
        raise FusionOff(f"arfuse: ARFUSE_VLLM=strict and the integration cannot run: "
                        f"{_disabled if first else f'{_disabled} (then: {reason})'}")


def _strict() -> bool:
    from .settings import strict_requested

    return strict_requested()


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def after_hook(owner: type, name: str, after: Callable[..., Any], label: str) -> None:
    """Replaces owner.name by a wrapper that calls the original with the caller's arguments, then
    returns after(self, result, args, kwargs) -- or the original's result when arfuse is off or
    `after` raises (then: disable, one log line). Idempotent (the wrapper is marked)."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)  # vLLM's own exceptions propagate as they are
        if not active():
            return result
        try:
            return after(self, result, args, kwargs)
        except FusionOff:
            raise
        except Exception as e:  # noqa: BLE001  (arfuse's failure must not stop vLLM)
            disable(f"{label}: {describe(e)}")
            return result

    setattr(wrapper, MARK, True)
    setattr(owner, name, wrapper)


def call_safely(label: str, fn: Callable[..., Any], *args: Any, default: Any = None) -> Any:
    """fn(*args), or `default` (and disable) when it raises."""
    try:
        return fn(*args)
    except FusionOff:
        raise
    except Exception as e:  # noqa: BLE001
        disable(f"{label}: {describe(e)}")
        return default
