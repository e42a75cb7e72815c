"""The "separate quantization kernel" of ``python -m arfuse.bench --quant KIND``: one Triton
kernel that reads the bf16/fp16 RMSNorm output once and writes its FP8-e4m3 quantization (and
the scales), with the same rules as arfuse's fused output kinds (arfuse/reference.py):

- fp8_static: q = saturate(y / scale), scale a float32 one-element tensor;
- fp8_token: scale = max(amax(|y_t|) / 448, 1 / (448 * 512)) per token, written to scales[t];
- fp8_group128: scale = max(amax, 1e-10) / 448 per group of 128 elements, scales[t, g] row-major.

One program per token, covering its whole row (per group: a [groups, 128] tile, one amax per
tile row). At 76fe666 the per-group kernel ran one program per 128 elements and moved only about
0.6 TB/s (docs/performance.md before bf1bb79); the per-token and static ones were as now. This is the kernel a
serving stack runs after a bf16 RMSNorm (vLLM's scaled_fp8_quant / per_token_group_quant_fp8 do
the same one read and one write); Triton is used so that the baseline is a single fused kernel
and not a chain of PyTorch ops. Needs triton (the GPU machine has it); imported lazily.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
KINDS = ("fp8_static", "fp8_token", "fp8_group128")
_kernel = None


def _build():
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, H,
                     BLOCK: tl.constexpr, MODE: tl.constexpr):
        # MODE 0: static scale, 1: per token; the whole row in one tile of BLOCK >= H.
        t = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        base = t.to(tl.int64) * H
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            scale = tl.load(static_ptr)
        else:
            amax = tl.max(tl.abs(x), axis=0)
            scale = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
            tl.store(s_ptr + t, scale)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + base + offs, y.to(tl.float8e4nv), mask=mask)

    @triton.jit
    def group_kernel(x_ptr, q_ptr, s_ptr, H, n_groups, GP: tl.constexpr):
        # Per group of 128: the row as a [GP, 128] tile (GP >= n_groups), one scale per tile row,
        # scales row-major [T, n_groups].
        t = tl.program_id(0)
        g = tl.arange(0, GP)
        e = tl.arange(0, 128)
        offs = t.to(tl.int64) * H + g[:, None] * 128 + e[None, :]
        mask = (g < n_groups)[:, None]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(amax, 1e-10) / 448.0
        tl.store(s_ptr + t.to(tl.int64) * n_groups + g, scale, mask=g < n_groups)
        y = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
        tl.store(q_ptr + offs, y.to(tl.float8e4nv), mask=mask)

    _kernel = (triton, quant_kernel, group_kernel)
    return _kernel


def quantize(y: torch.Tensor, kind: str, static_scale: torch.Tensor | None = None):
    """(q, scales) for y [T, H]: scales is None (static), [T] (token) or [T, H/128] (group)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} not one of {', '.join(KINDS)}")
    triton, kernel, group_kernel = _build()
    T, H = y.shape
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=y.device)
    if kind == "fp8_static":
        if static_scale is None:
            raise ValueError("fp8_static needs static_scale")
        scales = None
    elif kind == "fp8_token":
        scales = torch.empty(T, dtype=torch.float32, device=y.device)
    else:
        if H % 128:
            raise ValueError(f"fp8_group128: hidden {H} is not a multiple of 128")
        scales = torch.empty(T, H // 128, dtype=torch.float32, device=y.device)
    if T == 0:
        return q, scales
    if kind == "fp8_group128":
        group_kernel[(T,)](y, q, scales, H, H // 128, GP=triton.next_power_of_2(H // 128))
    else:
        static = static_scale if kind == "fp8_static" else scales  # unused pointer in mode 1
        kernel[(T,)](y, q, scales if scales is not None else static_scale, static, H,
                     BLOCK=triton.next_power_of_2(H), MODE=0 if kind == "fp8_static" else 1)
    return q, scales


def dequantize(q: torch.Tensor, kind: str, scales=None, static_scale=None) -> torch.Tensor:
    """float32 q * scale, the inverse of quantize (up to FP8 rounding), for the bench's check."""
    x = q.float()
    if kind == "fp8_static":
        return x * static_scale.float()
    if kind == "fp8_token":
        return x * scales.float().reshape(-1, 1)
    T, H = q.shape
    return (x.reshape(T, H // 128, 128) * scales.float().reshape(T, H // 128, 1)).reshape(T, H)
