"""The "separate quantization kernel" of ``python -m arfuse.bench --quant KIND``: one Triton
kernel that reads the bf16/fp16 RMSNorm output once and writes its FP8-e4m3 quantization (and
the scales), with the same rules as arfuse's fused output kinds (arfuse/reference.py):

- fp8_static: q = saturate(y / scale), scale a float32 one-element tensor;
- fp8_token: scale = max(amax(|y_t|) / 448, 1 / (448 * 512)) per token, written to scales[t];
- fp8_group128: scale = max(amax, 1e-10) / 448 per group of 128 elements, scales[t, g] row-major.

One program per (token, group); a per-token program covers the whole row. This is the kernel a
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
    def quant_kernel(x_ptr, q_ptr, s_ptr, static_ptr, H, n_groups,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
        pid = tl.program_id(0)
        t = pid // n_groups
        g = pid % n_groups
        offs = tl.arange(0, BLOCK)
        mask = offs < GROUP
        base = t.to(tl.int64) * H + g * GROUP
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:      # static
            scale = tl.load(static_ptr)
        elif MODE == 1:    # per token
            amax = tl.max(tl.abs(x), axis=0)
            scale = tl.maximum(amax / 448.0, 1.0 / (448.0 * 512.0))
            tl.store(s_ptr + t, scale)
        else:              # per group of 128
            amax = tl.max(tl.abs(x), axis=0)
            scale = tl.maximum(amax, 1e-10) / 448.0
            tl.store(s_ptr + pid, scale)
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        tl.store(q_ptr + base + offs, y.to(tl.float8e4nv), mask=mask)

    _kernel = (triton, quant_kernel)
    return _kernel


def quantize(y: torch.Tensor, kind: str, static_scale: torch.Tensor | None = None):
    """(q, scales) for y [T, H]: scales is None (static), [T] (token) or [T, H/128] (group)."""
    if kind not in KINDS:
        raise ValueError(f"kind: {kind!r} not one of {', '.join(KINDS)}")
    triton, kernel = _build()
    T, H = y.shape
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=y.device)
    if kind == "fp8_static":
        if static_scale is None:
            raise ValueError("fp8_static needs static_scale")
        scales, group, mode, sptr = None, H, 0, static_scale
    elif kind == "fp8_token":
        scales = torch.empty(T, dtype=torch.float32, device=y.device)
        group, mode, sptr = H, 1, scales
    else:
        if H % 128:
            raise ValueError(f"fp8_group128: hidden {H} is not a multiple of 128")
        scales = torch.empty(T, H // 128, dtype=torch.float32, device=y.device)
        group, mode, sptr = 128, 2, scales
    if T == 0:
        return q, scales
    n_groups = H // group
    kernel[(T * n_groups,)](y, q, scales if scales is not None else q, sptr, H, n_groups,
                            GROUP=group, BLOCK=triton.next_power_of_2(group), MODE=mode)
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
