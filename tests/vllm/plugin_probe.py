"""Run by test_plugin.py in a fresh process (vLLM loads general plugins once per process):
loads the plugins through vLLM's own loader and prints what the arfuse plugin did, as JSON.

Usage: python plugin_probe.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_harness as H  # noqa: E402  (sets the offline switches before vLLM is imported)

import torch  # noqa: E402
import vllm.plugins  # noqa: E402
from vllm.compilation.passes.pass_manager import PostGradPassManager  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

MARK = "__arfuse_vllm_hook__"


def main() -> None:
    root = Path(sys.argv[1])
    original = {"configure": PostGradPassManager.configure, "hash": VllmConfig.compute_hash}
    config = H.vllm_config(root, H.QWEN3_MOE, torch.bfloat16)
    hash_before = config.compute_hash()

    found = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "arfuse"]
    vllm.plugins.load_general_plugins()
    vllm.plugins.load_general_plugins()  # vLLM loads once per process
    from arfuse.vllm import plugin

    plugin.register()  # and the plugin itself is re-entrant

    configure = PostGradPassManager.configure
    worker_hooked = None
    try:
        from vllm.v1.worker.gpu_worker import Worker

        worker_hooked = getattr(Worker.load_model, MARK, False)
    except Exception as e:  # noqa: BLE001
        worker_hooked = f"not importable: {e}"

    # vLLM running with tensor parallelism 1: the hooks must change nothing.
    H.ensure_distributed(config)
    pm = PostGradPassManager()
    with set_current_vllm_config(config):
        pm.configure(config)
    comm = plugin.get_communicator(config)

    print(
        json.dumps(
            {
                "entry_points": found,
                "registered": plugin.is_registered(),
                "configure_hooked": getattr(configure, MARK, False),
                "configure_wrapped_once": getattr(configure, "__wrapped__", None)
                is original["configure"],
                "hash_hooked": getattr(VllmConfig.compute_hash, MARK, False),
                "worker_hooked": worker_hooked,
                "hash_before": hash_before,
                "hash_after": config.compute_hash(),
                "tp1_passes": [type(p).__name__ for p in pm.passes],
                "tp1_communicator": comm is not None,
            }
        )
    )


if __name__ == "__main__":
    main()
