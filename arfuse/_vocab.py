"""The vocabulary arfuse shares with its generator and its C++ code: the activation dtypes, the
all-reduce algorithms, the output kinds and the kernel limits.

The Go tables own it (gen/tables.go). The generator prints them into arfuse/_vocab_tables.py
(TABLES, checked in; gen --check fails while it is not what the tables say), as it prints them into
csrc/arfuse/vocab.h for the C++; this module builds the package's names from those rows. Every other
module of the package spells dtypes, algorithms and output kinds through the names defined here.

Each list is in the order of its C++ enum (csrc/arfuse/vocab.h): an entry's position is the
integer the torch ops take and return for it (`comm_info()[3]` is a dtype's position, the ops'
`algorithm` argument an algorithm's, `instance_for`'s `out_kind` an output kind's).
"""

from __future__ import annotations

import torch

from ._vocab_tables import TABLES as _TABLES

# Dtypes: short name (YAML, variant names, the benchmark's --dtype) -> torch dtype.
DTYPE_NAMES: tuple[str, ...] = tuple(d["name"] for d in _TABLES["dtypes"])
TORCH_DTYPES: tuple[torch.dtype, ...] = tuple(getattr(torch, d["torch"]) for d in _TABLES["dtypes"])
DTYPES: dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, TORCH_DTYPES))
DTYPE_NAME_OF: dict[torch.dtype, str] = {t: n for n, t in DTYPES.items()}

# Algorithms: name -> the ops' `algorithm` argument. "auto" is resolved on the host: "local" at
# world size 1 (LOCAL_ALGORITHMS: no all-reduce, the world-size-1 op), else one-shot or two-shot
# by token count (KERNEL_ALGORITHMS: the all-reduce algorithms, world sizes 2 and up).
ALGORITHMS: dict[str, int] = {name: i for i, name in enumerate(_TABLES["algorithms"])}
LOCAL_ALGORITHMS: tuple[str, ...] = tuple(_TABLES["local_algorithms"])
KERNEL_ALGORITHMS: tuple[str, ...] = tuple(a for a in _TABLES["algorithms"]
                                           if a != "auto" and a not in LOCAL_ALGORITHMS)


def algorithms_for(world_size: int) -> tuple[str, ...]:
    """The kernel algorithms that serve world size `world_size`: local at 1, else the
    all-reduce algorithms."""
    return LOCAL_ALGORITHMS if world_size == 1 else KERNEL_ALGORITHMS

# Output kinds, one row of traits each (gen/tables.go OutKind): name -> arfuse::OutKind value, and
# OUTPUT_ROWS name -> its row:
#   torch    the dtype of norm_out ("" = the activation dtype), OUTPUT_DTYPES below;
#   scales   "none" (norm), "input" (a float32 one-element fp8_scale, torch.ops.arfuse.fused),
#            "token" ([T]) or "group" ([T, H / group]): written by the kernel and returned
#            (torch.ops.arfuse.fused_fp8_dynamic, which takes the kind's group as group_size);
#   group    elements per scale of "group" scales, else 0;
#   bounded  takes scale_ub (an upper bound of amax); layouts: takes scale_layout / scale_ue8m0.
# "norm" writes the activation dtype; the others (QUANT_KINDS, moe_finalize_allreduce_rmsnorm's
# quant=) are quantized. arfuse/reference.py holds one reference quantizer per row (QUANTIZERS).
OUTPUTS: dict[str, int] = {o["name"]: i for i, o in enumerate(_TABLES["outputs"])}
OUTPUT_ROWS: dict[str, dict] = {o["name"]: o for o in _TABLES["outputs"]}
OUTPUT_DTYPES: dict[str, torch.dtype | None] = {
    o["name"]: getattr(torch, o["torch"]) if o["torch"] else None for o in _TABLES["outputs"]}
QUANT_KINDS: tuple[str, ...] = tuple(o["name"] for o in _TABLES["outputs"] if o["scales"] != "none")
# The kinds whose scales the kernel writes (fused_fp8_dynamic), and the one that takes an input
# scale (fused's fp8_scale).
DYNAMIC_KINDS: tuple[str, ...] = tuple(o["name"] for o in _TABLES["outputs"]
                                       if o["scales"] in ("token", "group"))
STATIC_KIND: str = next(o["name"] for o in _TABLES["outputs"] if o["scales"] == "input")
# Elements per quantization group of the output kinds that have groups (fp8_group128: 128).
QUANT_GROUP_SIZES: dict[str, int] = {o["name"]: o["group"] for o in _TABLES["outputs"] if o["group"]}


def dynamic_kind(group_size: int) -> str | None:
    """The kind fused_fp8_dynamic serves for group_size (its row's group), or None."""
    return next((n for n in DYNAMIC_KINDS if OUTPUT_ROWS[n]["group"] == group_size), None)


def kinds_with(trait: str) -> tuple[str, ...]:
    """The output kinds whose row has `trait` ("bounded", "layouts") set."""
    return tuple(o["name"] for o in _TABLES["outputs"] if o[trait])


# Kernel limits (csrc/arfuse/vocab.h, asserted by kernel.cuh; the generator's plan).
LIMITS: dict[str, int] = dict(_TABLES["limits"])
MAX_WORLD: int = LIMITS["max_world"]    # largest group a communicator serves
MAX_TOP_K: int = LIMITS["max_top_k"]    # most experts per token the op accepts
QUANT_GROUP: int = LIMITS["quant_group"]  # elements per scale of fp8_group128
