"""The benchmark's input sets and what a call must return for them: random per-rank inputs (never
zeros), FlashInfer's views of them, and the float32 reference of the op's definition with the
relative-error measure the correctness guard applies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group import Setup

TOLERANCE = {"bf16": 1e-2, "fp16": 2e-3, "fp32": 1e-5}

@dataclass
class RankInputs:
    expert_out: torch.Tensor          # [P, H] permuted, [T, K, H] dense, [T, H] plain
    residual: torch.Tensor            # [T, H], identical on every rank (replicated)
    idx: torch.Tensor | None = None   # [T, K] int32 (permuted), -1 = expert absent
    weights: torch.Tensor | None = None  # [T, K] positive, rows sum to 1, identical on all ranks
    shared: torch.Tensor | None = None   # [T, H] this rank's shared-expert partial
    valid_rows: object = 0            # int, or a device scalar (permuted)
    fi: dict | None = None            # FlashInfer views (pattern 7): rows, idx, weights


def make_sets(setup: Setup, T: int, n_sets: int) -> list:
    """n_sets input sets; sets[s][rank] -> RankInputs. Random, never zeros. Replicated tensors
    (residual, weights) hold the same values on every rank, in separate memory per rank."""
    a = setup.args
    H, K, dev, dt = a.hidden, a.topk, setup.device, setup.dtype
    g = torch.Generator(device=dev)
    sets = []
    for s in range(n_sets):
        g.manual_seed(a.seed * 1_000_003 + T * 7919 + s)  # same on every rank
        residual = torch.randn(T, H, generator=g, device=dev, dtype=dt)
        weights = None
        if a.layout != "plain" and a.weights_dtype != "none":
            weights = torch.softmax(torch.randn(T, K, generator=g, device=dev), dim=-1)
            weights = weights.to(setup.weight_dtype)
        per = {}
        for r in setup.ranks:
            g.manual_seed(a.seed * 1_000_003 + T * 7919 + s + 104_729 * (r + 1))
            inp = RankInputs(expert_out=None, residual=residual.clone(),
                             weights=None if weights is None else weights.clone())
            if a.layout == "plain":
                inp.expert_out = torch.randn(T, H, generator=g, device=dev, dtype=dt)
                inp.valid_rows = T
            elif a.layout == "dense":
                inp.expert_out = torch.randn(T, K, H, generator=g, device=dev, dtype=dt)
                inp.valid_rows = T * K
            else:
                inp.expert_out = torch.randn(T * K, H, generator=g, device=dev, dtype=dt)
                idx = torch.randperm(T * K, generator=g, device=dev).to(torch.int32)
                absent = torch.rand(T * K, generator=g, device=dev) < a.absent_frac
                idx.masked_fill_(absent, -1)
                inp.idx = idx.view(T, K)
                inp.valid_rows = T * K - absent.sum()  # a device scalar until mean_valid_rows
            if a.shared:
                inp.shared = 0.5 * torch.randn(T, H, generator=g, device=dev, dtype=dt)
            per[r] = inp
        sets.append(per)
    return sets


def add_flashinfer_views(setup: Setup, sets: list) -> None:
    """FlashInfer's pattern 7 takes [P, H] rows, int32 [T, K] indices and weights in the
    activation dtype, and no routed_scaling (its unified API passes none): the weights carry
    routed_scaling, and -1 indices are redirected to row 0 with weight 0 (its fused kernel is not
    documented to skip -1)."""
    sc = float(setup.args.routed_scaling)
    for per in sets:
        for inp in per.values():
            if setup.args.layout == "permuted":
                valid = inp.idx >= 0
                inp.fi = {"rows": inp.expert_out, "idx": inp.idx.clamp(min=0),
                          "weights": (inp.weights.float() * sc * valid).to(setup.dtype)}
            elif setup.args.layout == "dense":
                T, K, H = inp.expert_out.shape
                w = (torch.ones(T, K, device=setup.device) if inp.weights is None
                     else inp.weights.float())
                inp.fi = {"rows": inp.expert_out.view(T * K, H),
                          "idx": torch.arange(T * K, device=setup.device,
                                              dtype=torch.int32).view(T, K),
                          "weights": (w * sc).to(setup.dtype)}


def mean_valid_rows(sets: list) -> int:
    """Mean over sets and ranks of the rows with an index >= 0 (one device sync)."""
    v = [inp.valid_rows for per in sets for inp in per.values()]
    if any(torch.is_tensor(x) for x in v):
        t = torch.stack([x if torch.is_tensor(x) else torch.tensor(x, device=v[0].device)
                         for x in v]).double()
        return int(round(t.mean().item()))
    return int(round(sum(v) / len(v)))


def reference(setup: Setup, per: dict):
    """(norm_out, residual_out) in float32 by arfuse.reference, the op's definition: each rank's
    partial in float32, rounded once to the activation dtype, summed in rank order, + residual,
    rounded, RMSNorm of the rounded residual_out. The same for every rank (replicated residual)."""
    from arfuse import reference as ref

    a = setup.args
    partials = []
    for r in setup.ranks:
        inp = per[r]
        p = ref.finalize(inp.expert_out, num_tokens=inp.residual.shape[0], permuted_idx=inp.idx,
                         expert_weights=inp.weights, shared_out=inp.shared,
                         routed_scaling=float(a.routed_scaling), acc=torch.float32)
        partials.append(p.to(setup.dtype))
        del p
    if not setup.emulated:  # every rank's partial, in rank order
        mine = partials[0]
        # gathered along dim 0 ([world * T, H]): gloo takes no stacked [world, T, H] output
        allp = torch.empty((setup.world_size * mine.shape[0],) + tuple(mine.shape[1:]),
                           dtype=mine.dtype, device=mine.device)
        dist.all_gather_into_tensor(allp, mine.contiguous())
        partials = list(allp.view((setup.world_size,) + tuple(mine.shape)).unbind(0))
    residual = per[setup.ranks[0]].residual
    norm, resid_out = ref.allreduce_add_rmsnorm(partials, residual, setup.gamma,
                                                float(a.eps), float(a.weight_bias), setup.dtype,
                                                acc=torch.float32)
    return norm.float(), resid_out.float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; inf for non-finite outputs."""
    o = out.float()
    if not torch.isfinite(o).all():
        return math.inf
    den = ref.abs().max().item()
    return (o - ref).abs().max().item() / max(den, 1e-30)
