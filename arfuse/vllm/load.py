"""After vLLM's Worker.load_model: the communicator for the tensor-parallel group, the MoE layers'
rows switch, and at TP > 1 the ranks' agreement to fuse together or not at all, then the watch on
every step (arfuse.vllm.plugin and arfuse.vllm.slot install the hook)."""

from __future__ import annotations

from typing import Any

from . import communicators as _comms
from . import contract as _contract
from . import guard as _guard
from . import settings as _settings
from .contract.installed import check_installed as _check_installed
from .guard import logger

# The config of the last Worker.load_model in this process (the slot pass falls back to it).
_worker_config: Any = None


def after_load_model(worker: Any, result: Any, args: Any, kwargs: Any) -> Any:
    """The plugin's Worker.load_model hook: vLLM loaded the weights, then this (with the rows
    switch unless ARFUSE_VLLM_MOE_ROWS=0)."""
    return _after_load(worker, result, rows=True)


def after_load_model_slot(worker: Any, result: Any, args: Any, kwargs: Any) -> Any:
    """The slot's Worker.load_model hook: the same without the rows switch (the slot's pass runs
    after vLLM's fusions on the finalized output, so the MoE layers keep vLLM's finalize)."""
    return _after_load(worker, result, rows=False)


def _after_load(worker: Any, result: Any, *, rows: bool) -> Any:
    global _worker_config
    config = _worker_config = worker.vllm_config
    if _comms.tensor_parallel_size() <= 1:  # no peers: nothing to agree on
        comm = _comms.get_communicator(config)
        if comm is not None and rows:
            switch_moe_rows(config)
        return result
    # Tensor parallelism > 1: the ranks fuse together or not at all. A rank that cannot (no
    # library, no kernel, a failed switch) would otherwise run vLLM's all-reduce while its peers
    # wait in arfuse's kernel for it. Two agreements over the TP group's CPU (gloo) group: before
    # the communicator is created (collectively), and after the MoE layers were switched.
    ok, why = _step(lambda: _comms.plan(config) is not None)
    if not _agree(ok, why, "before creating the communicator"):
        return result
    comm = _comms.get_communicator(config)
    switched: list[str] = []

    def switch() -> bool:
        if rows:
            switched.extend(switch_moe_rows(config))
        return comm is not None

    ok, why = _step(switch)
    if _agree(ok, why, "after switching the MoE layers"):
        from . import watch

        # every step's result leaves only after the communicators' error words were read
        _guard.after_hook(type(worker), "execute_model", watch.after_step,
                          "Worker.execute_model hook")
    else:
        from . import moe_rows

        n = moe_rows.restore(config)
        if n:
            logger.info("arfuse: vLLM's own finalize put back in %d MoE layers", n)
    return result


def _step(fn: Any) -> tuple[bool, str]:
    """(whether fn() returned true and arfuse is still on in this process, why not)."""
    try:
        ok = bool(fn()) and _guard.active()
    except _guard.FusionOff:
        raise
    except Exception as e:  # noqa: BLE001  (the agreement must still be reached on every rank)
        return False, _guard.describe(e)
    return ok, "" if ok else (_guard.disabled_reason() or "nothing to fuse")


def _agree(ok: bool, why: str, when: str) -> bool:
    """Whether every rank of vLLM's tensor-parallel group is ok (all_gather over its CPU group).
    Where one is not, every rank switches arfuse off with one line naming the first such rank and
    its reason (in strict mode: raises)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    gathered: list = [None] * tp.world_size
    dist.all_gather_object(gathered, (ok, why), group=tp.cpu_group)
    bad = [(r, w) for r, (o, w) in enumerate(gathered) if not o]
    if not bad:
        return True
    rank, reason = bad[0]
    _guard.disable(f"{when}: rank {rank} of the tensor-parallel group cannot fuse ({reason}); "
                   f"every rank of the group stays unfused")
    return False


_rows_problems: list[str] | None = None


def switch_moe_rows(vllm_config: Any) -> list[str]:
    """Hands the finalize of the model's eligible MoE layers to arfuse (arfuse.vllm.moe_rows),
    unless ARFUSE_VLLM_MOE_ROWS=0 or this vLLM lacks something the switch needs (contract items
    of need "rows": one log line, the switch stays off). Returns the switched layer names."""
    global _rows_problems
    if not _settings.from_env().moe_rows:
        return []
    if _rows_problems is None:
        _rows_problems = _contract.summarize(_check_installed(needs=("rows",)))
        if _rows_problems:
            logger.warning("arfuse: MoE finalize stays in vLLM: this vLLM lacks %s",
                           "; ".join(_rows_problems))
    if _rows_problems:
        return []
    from . import moe_rows

    return moe_rows.switch(vllm_config)[0]


def worker_config() -> Any:
    """The VllmConfig of the last Worker.load_model in this process (None before)."""
    return _worker_config
