"""Run by test_guard.py in a fresh process: registers the plugin (ARFUSE_VLLM=1) on the real vLLM,
makes one thing fail, and prints as JSON what vLLM's hooked methods did next to what vLLM's
originals do, and what the arfuse logger said.

Usage: python guard_probe.py MODEL_DIR SCENARIO

  vllm-raises            vLLM's own configure raises (config None): must pass through unchanged
  pass-raises            the arfuse pass constructor raises (tensor parallelism faked to 2)
  communicator-raises    get_communicator raises inside the pass constructor (TP faked to 2)
  worker-raises          get_communicator raises in the Worker.load_model hook
  cache-key-raises       the cache-key hook's own step raises
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_harness as H  # noqa: E402

import torch  # noqa: E402
from vllm.compilation.caching import aot_compile_hash_factors  # noqa: E402
from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402

from arfuse.vllm import cache_key, communicators, fusion, guard, plugin  # noqa: E402


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.INFO and "integration enabled" not in record.getMessage():
            self.lines.append(record.getMessage())


def boom(*args, **kwargs):
    raise RuntimeError("arfuse-test-boom")


def configured(config, configure) -> list[str]:
    pm = PostGradPassManager()
    with set_current_vllm_config(config):
        configure(pm, config)
    return [type(p).__name__ for p in pm.passes]


def error_of(fn, *args) -> str | None:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    root, scenario = Path(sys.argv[1]), sys.argv[2]
    log = Lines()
    logging.getLogger("vllm.arfuse").addHandler(log)
    # vLLM 0.34 configures its loggers only when its CLI or engine starts (up to 0.33: on import);
    # what arfuse logs at INFO must be seen here either way.
    logging.getLogger("vllm.arfuse").setLevel(logging.INFO)
    config = H.vllm_config(root, H.QWEN3_MOE, torch.bfloat16)
    H.ensure_distributed(config)
    if scenario == "cache-key-raises":
        cache_key.after_compute_hash = cache_key.after_compile_factors = boom
    plugin.register()
    assert plugin.is_registered(), log.lines
    hooked = PostGradPassManager.configure
    original = hooked.__wrapped__
    out: dict = {"scenario": scenario}

    if scenario == "vllm-raises":
        out["original_error"] = error_of(original, PostGradPassManager(), None)
        out["hooked_error"] = error_of(hooked, PostGradPassManager(), None)
    elif scenario in ("pass-raises", "communicator-raises"):
        communicators.tensor_parallel_size = lambda: 2  # the pass is built only for TP > 1
        if scenario == "pass-raises":
            fusion.ArfuseAllReduceFusionPass.__init__ = boom
        else:
            communicators.get_communicator = boom
        out["original_passes"] = configured(config, original)
        out["hooked_passes"] = configured(config, hooked)
    elif scenario == "worker-raises":
        from vllm.v1.worker.gpu_worker import Worker

        # vLLM's real Worker.load_model, run on a Worker whose collaborators do nothing (no GPU
        # here): the model runner's load_model is recorded.
        calls: list[bool] = []
        w = object.__new__(Worker)
        w.vllm_config = config
        w.model_runner = SimpleNamespace(load_model=lambda load_dummy_weights: calls.append(True))
        w._maybe_get_memory_pool_context = lambda tag: contextlib.nullcontext()
        w._scoped_allocator_max_split = lambda max_split_size_mb: contextlib.nullcontext()
        w._external_weight_charges = SimpleNamespace(track=contextlib.nullcontext,
                                                     fallback_bytes=0)
        communicators.get_communicator = boom
        out["result"] = repr(Worker.load_model(w))
        out["model_runner_calls"] = len(calls)
        out["worker_hooked"] = getattr(Worker.load_model, guard.MARK, False)

    # After any failure: the hooks pass through (cache key as without arfuse).
    name = "compute_hash" if hasattr(type(config), "compute_hash") else "compile_factors"
    method = getattr(type(config), name)
    out["key_hooked"] = aot_compile_hash_factors(config)[1]
    setattr(type(config), name, method.__wrapped__)
    out["key_original"] = aot_compile_hash_factors(config)[1]
    setattr(type(config), name, method)
    out["disabled"] = guard.disabled_reason()
    out["log"] = log.lines
    print(json.dumps(out))


if __name__ == "__main__":
    main()
