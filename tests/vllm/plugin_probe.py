"""Run by test_plugin.py in a fresh process (vLLM loads general plugins once per process):
loads the plugins through vLLM's own loader and prints what the arfuse plugin did, as JSON.

Usage: python plugin_probe.py MODEL_DIR [SCENARIO]

SCENARIO (default "plain") changes something before the plugins load, to see the plugin cope:
  no-configure      PostGradPassManager without configure (as a release that renamed it)
  newer             the installed vLLM taken for a release newer than the supported ones
  newer-no-configure  both
  import-error      arfuse.vllm.contract cannot be imported (as in a wheel that lacked it)
  no-kernel         the model's hidden size is one no arfuse kernel serves

Exceptions that the plugins' loading or the communicator lookup raise (ARFUSE_VLLM=strict) are
reported under "raised" (None when nothing was raised).
"""

from __future__ import annotations

import json
import logging
import sys
from importlib.metadata import entry_points
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_harness as H  # noqa: E402  (sets the offline switches before vLLM is imported)

import torch  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.compilation.caching import aot_compile_hash_factors  # noqa: E402
from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

MARK = "__arfuse_vllm_hook__"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.levels: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO:
            self.lines.append(record.getMessage())
            self.levels.append(record.levelname)


def cache_key(config: VllmConfig) -> list[str]:
    """vLLM's own compile-cache key factors for `config`: the env hash and the config hash (the
    Inductor factors that may follow are bytes on some releases and no business of arfuse)."""
    return [str(f) for f in aot_compile_hash_factors(config)[:2]]


def cache_key_variants(config: VllmConfig) -> list[str]:
    """The config hash as FlashInfer's autotune cache asks for it (0.30+: include_version=False)."""
    out = []
    if hasattr(VllmConfig, "compute_hash"):
        try:
            out.append(config.compute_hash(include_version=False))
        except TypeError as e:  # 0.26-0.29: no such keyword, in vLLM's own method too
            out.append(f"TypeError: {e}")
    else:
        out.append(json.dumps(config.compile_factors(include_version=False), sort_keys=True,
                              default=str))
    return out


class _Blocker:
    """A meta-path finder under which one module cannot be imported."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name:
            raise ImportError(f"No module named {fullname!r} (blocked by the probe)")
        return None


def main() -> None:
    root = Path(sys.argv[1])
    scenario = sys.argv[2] if len(sys.argv) > 2 else "plain"
    log = Lines()
    logging.getLogger("vllm.arfuse").addHandler(log)
    # vLLM 0.34 configures its loggers only when its CLI or engine starts (up to 0.33: on import);
    # what arfuse logs at INFO must be seen here either way.
    logging.getLogger("vllm.arfuse").setLevel(logging.INFO)
    hash_name = "compute_hash" if hasattr(VllmConfig, "compute_hash") else "compile_factors"
    original = {"configure": PostGradPassManager.configure, "hash": getattr(VllmConfig, hash_name)}
    # no-kernel: a hidden size above every kernel's limit (arfuse._vocab: max_hidden 65536)
    spec = H.zoo_spec(65536 + 8) if scenario == "no-kernel" else H.QWEN3_MOE
    config = H.vllm_config(root, spec, torch.bfloat16)
    key_before = cache_key(config)
    variants_before = cache_key_variants(config)
    if scenario in ("no-configure", "newer-no-configure"):
        del PostGradPassManager.configure
    if scenario.startswith("newer"):
        from arfuse.vllm import plugin as _plugin

        _plugin._vllm_version = lambda: "0.35.0"
    worker_hooked = None
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError as e:
        Worker = None
        worker_hooked = f"not importable: {e}"

    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "arfuse"]
    blocker = _Blocker("arfuse.vllm.contract") if scenario == "import-error" else None
    if blocker is not None:
        sys.meta_path.insert(0, blocker)
    raised = None
    try:
        vllm.plugins.load_general_plugins()
        vllm.plugins.load_general_plugins()  # vLLM loads once per process
    except Exception as e:  # noqa: BLE001  (ARFUSE_VLLM=strict)
        raised = f"{type(e).__name__}: {e}"
    if blocker is not None:
        sys.meta_path.remove(blocker)
        for name in [m for m in sys.modules if m.startswith("arfuse.vllm")]:
            del sys.modules[name]
    from arfuse.vllm import communicators, guard, plugin

    if blocker is None and raised is None:
        plugin.register()  # and the plugin itself is re-entrant

    configure = getattr(PostGradPassManager, "configure", None)
    if Worker is not None:
        worker_hooked = getattr(getattr(Worker, "load_model", None), MARK, False)

    # vLLM running with tensor parallelism 1: off, the hooks change nothing; on, the pass holds
    # the MoE-tail patterns on the expert rows only (no all-reduce in the graph) and the
    # communicator has world size 1.
    H.ensure_distributed(config)
    pm = PostGradPassManager()
    if configure is not None:
        with set_current_vllm_config(config):
            try:
                pm.configure(config)
            except Exception as e:  # noqa: BLE001  (ARFUSE_VLLM=strict)
                raised = raised or f"{type(e).__name__}: {e}"
    # Only the plugin's own hooks ask for a communicator (none run while it is off).
    comm = None
    if plugin.is_registered():
        try:
            comm = communicators.get_communicator(config)
        except Exception as e:  # noqa: BLE001  (ARFUSE_VLLM=strict)
            raised = raised or f"{type(e).__name__}: {e}"

    print(
        json.dumps(
            {
                "scenario": scenario,
                "entry_points": found,
                "registered": plugin.is_registered(),
                "disabled": guard.disabled_reason(),
                "log": log.lines,
                "levels": log.levels,
                "raised": raised,
                "arfuse_modules": sorted(m for m in sys.modules if m.startswith("arfuse")),
                "hash_method": hash_name,
                "configure_hooked": getattr(configure, MARK, False),
                "configure_wrapped_once": getattr(configure, "__wrapped__", None)
                is original["configure"],
                "hash_hooked": getattr(getattr(VllmConfig, hash_name), MARK, False),
                "hash_wrapped_once": getattr(getattr(VllmConfig, hash_name), "__wrapped__", None)
                is original["hash"],
                "worker_hooked": worker_hooked,
                "key_before": key_before,
                "key_after": cache_key(config),
                "variants_before": variants_before,
                "variants_after": cache_key_variants(config),
                "tp1_passes": [type(p).__name__ for p in pm.passes],
                "tp1_communicator": comm is not None,
                "tp1_world": None if comm is None else comm.world_size,
                "tp1_kinds": sorted({s.kind for p in pm.passes
                                     for s in getattr(getattr(p, "inner", p), "specs", [])}),
            }
        )
    )


if __name__ == "__main__":
    main()
