"""arfuse's `vllm.general_plugins` entry point (`arfuse = "arfuse_vllm_plugin:register"`).

vLLM imports every general plugin in every process it starts (API server, engine core, workers)
and calls it. This module is top-level so that importing it imports nothing else: the arfuse
package's own import loads the compiled CUDA library, and arfuse.vllm.plugin reaches into vLLM's
internals. While ARFUSE_VLLM is unset (or 0) register() reads one environment variable and
returns: no import, no library, no log line.

With ARFUSE_VLLM=1 it imports arfuse.vllm.plugin and hands over. When the integration cannot
start (arfuse does not import, the library is missing, the vLLM release lacks what arfuse needs,
no kernel serves the model) arfuse logs one ERROR line naming the reason and saying that fusion
is OFF, and vLLM runs on without it; ARFUSE_VLLM=strict turns each of these into an exception,
so that vLLM does not start at all (docs/vllm.md, "Switching it on").
"""

from __future__ import annotations

import os

# The values that leave the integration off; everything else is read by arfuse.vllm.settings
# (which names a malformed value in its ERROR line).
_OFF = {"", "0", "false", "no", "off"}


def register() -> None:
    """The entry point. Never raises unless ARFUSE_VLLM=strict and the integration cannot start."""
    raw = os.environ.get("ARFUSE_VLLM", "").strip().lower()
    if raw in _OFF:
        return
    try:
        from arfuse.vllm import plugin
    except Exception as e:  # noqa: BLE001  (an install that lacks a module, a broken torch, ...)
        import logging

        reason = (f"cannot import arfuse.vllm.plugin ({type(e).__name__}: "
                  f"{str(e).splitlines()[0] if str(e) else ''})")
        logging.getLogger("vllm.arfuse").error(
            "arfuse: fusion is OFF in this process: %s", reason)
        if raw == "strict":
            raise RuntimeError(f"arfuse: ARFUSE_VLLM=strict and the integration cannot start: "
                               f"{reason}") from e
        return
    plugin.register()
