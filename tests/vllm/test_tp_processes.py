"""vLLM's MoE decoder layers at tensor parallelism 2 as two real processes sharing one GPU, with
the arfuse plugin as vLLM loads it (tp_probe.py says what each rank runs, checks and what
differs from a deployment). Needs a GPU and vLLM's CUDA build (the GPU machine:
scripts/vllm-gpu-tp.sh runs the same probe for more cases); skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import checkout
import vllm_harness as H

H.require_vllm()
H.require_arfuse()

pytestmark = pytest.mark.gpu
PROBE = Path(__file__).with_name("tp_probe.py")


@pytest.mark.parametrize("case, hidden", [("qwen3-moe", 2048), ("deepseek-v3", 7168),
                                          ("qwen3-moe-fp8", 2048), ("deepseek-v3-fp8", 7168)])
def test_decoder_layers_at_tp2_in_two_processes(case, hidden, tmp_path):
    env = checkout.pythonpath(os.environ)
    env.update(CASE=case, HIDDEN=str(hidden), OUT=str(tmp_path), ARFUSE_VLLM="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", str(PROBE)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    for rank in range(2):
        f = tmp_path / f"tp-{rank}.json"
        assert f.exists(), f"rank {rank} wrote no result (exit {p.returncode})\n{p.stdout[-4000:]}"
        res = json.loads(f.read_text())
        assert res["ok"], json.dumps({k: v for k, v in res.items() if k != "arfuse_log"},
                                     indent=1)[-4000:]
        assert res["fused_all_reduces_left"] == 0 and res["arfuse_kernels_per_call"] > 0
        assert res["ranks_bitwise_equal"] and res["graph_replays_identical"]
    assert p.returncode == 0, p.stdout[-4000:]
