"""vLLM's TritonExperts on the CPU, for the tests of arfuse.vllm.moe_rows (tests/vllm/rows_probe.py).

vLLM's Triton MoE kernels run on the CPU under Triton's interpreter (TRITON_INTERPRET=1, and
CUDA_VISIBLE_DEVICES="" before vLLM is imported: without an active GPU driver vLLM otherwise
swaps Triton for a placeholder). What does not run there is replaced here, in the test process
only:

* vLLM's CUDA-only ops on that path (their libraries need libcuda.so.1): PyTorch stand-ins with
  the schemas of vLLM's _C / _moe_C libraries (0.26.0 and 0.34.0), registered only where
  missing. moe_sum counts its calls (CALLS), so a test can see that the rows path skips it.
* Three defects of Triton's interpreter (3.6.0 and 3.8.0): a bf16 tl.dot multiplies the raw
  bit patterns (triton-lang/triton#11584), float32 -> bf16 casts truncate instead of rounding to
  nearest even, and float32 -> fp8 rounding loses the carry into the exponent. The GPU does
  neither; the patches route those conversions through torch.

None of this touches vLLM's code or the arfuse code under test."""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)

_libs = []
CALLS: dict[str, int] = {}


def _count(name):
    CALLS[name] = CALLS.get(name, 0) + 1


def silu_and_mul(result, input):
    _count("silu_and_mul")
    d = input.shape[-1] // 2
    x = input.float()
    result.copy_((F.silu(x[..., :d]) * x[..., d:]).to(result.dtype))


def moe_sum(input, output, topk_ids=None, expert_map=None):
    _count("moe_sum")
    x = input.float()
    if expert_map is not None and topk_ids is not None:
        keep = (expert_map[topk_ids.long()] >= 0).unsqueeze(-1)
        x = torch.where(keep, x, torch.zeros_like(x))
    output.copy_(x.sum(dim=1).to(output.dtype))


def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, maybe_expert_map=None, scatter_idx=None):
    """CUDA kernel semantics: tokens (flattened topk slots) grouped by expert, each group padded
    to a multiple of block_size with the sentinel numel; one expert id per block."""
    _count("moe_align_block_size")
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    sorted_token_ids.fill_(numel)
    experts_ids.fill_(-1)
    pos = 0
    blk = 0
    for e in range(num_experts):
        if maybe_expert_map is not None and int(maybe_expert_map[e]) < 0:
            continue  # ignore_invalid_experts
        idx = torch.nonzero(flat == e, as_tuple=False).reshape(-1)
        n = idx.numel()
        if n == 0:
            continue
        padded = (n + block_size - 1) // block_size * block_size
        sorted_token_ids[pos:pos + n] = idx.to(sorted_token_ids.dtype)
        nb = padded // block_size
        local = e if maybe_expert_map is None else int(maybe_expert_map[e])
        experts_ids[blk:blk + nb] = local
        pos += padded
        blk += nb
    num_tokens_post_pad.fill_(pos)
    if scatter_idx is not None:
        raise NotImplementedError("scatter_idx")


def silu_and_mul_per_block_quant(out, input, scales, group_size, scale_ub=None,
                                 is_scale_transposed=False):
    _count("silu_and_mul_per_block_quant")
    d = input.shape[-1] // 2
    x = input.float()
    y = (F.silu(x[..., :d]) * x[..., d:]).to(input.dtype).float()
    g = y.view(y.shape[0], d // group_size, group_size)
    s = g.abs().amax(dim=-1).clamp(min=1e-10) * (1.0 / FP8_MAX)
    if scale_ub is not None:
        s = torch.minimum(s, scale_ub.float())
    q = (g / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(out.dtype)
    out.copy_(q.view_as(out))
    scales.copy_(s.view_as(scales) if not is_scale_transposed else s)


def per_token_group_fp8_quant(input, output_q, output_s, group_size, eps, fp8_min, fp8_max,
                              scale_ue8m0, dummy_is_scale_transposed, dummy_is_tma_aligned):
    _count("per_token_group_fp8_quant")
    x = input.float()
    g = x.view(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    s = g.abs().amax(dim=-1).clamp(min=eps) / fp8_max
    if scale_ue8m0:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (g / s.unsqueeze(-1)).clamp(fp8_min, fp8_max).to(output_q.dtype)
    output_q.copy_(q.view_as(output_q))
    output_s.copy_(s.view(output_s.shape) if output_s.is_contiguous() else s)


SCHEMAS = {
    ("_C", "silu_and_mul"): ("silu_and_mul(Tensor! result, Tensor input) -> ()", silu_and_mul),
    ("_C", "silu_and_mul_per_block_quant"): (
        "silu_and_mul_per_block_quant(Tensor! out, Tensor input, Tensor! scales, int group_size, "
        "Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
        silu_and_mul_per_block_quant),
    ("_C", "per_token_group_fp8_quant"): (
        "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
        "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
        "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()",
        per_token_group_fp8_quant),
    ("_moe_C", "moe_sum"): (
        "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
        moe_sum),
    ("_moe_C", "moe_align_block_size"): (
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
        "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad, "
        "Tensor? maybe_expert_map, Tensor(a!)? scatter_idx=None) -> ()",
        moe_align_block_size),
}


def register() -> list[str]:
    done = []
    libs = {}
    for (ns, name), (schema, fn) in SCHEMAS.items():
        if hasattr(getattr(torch.ops, ns), name):
            continue
        lib = libs.get(ns)
        if lib is None:
            lib = libs[ns] = torch.library.Library(ns, "FRAGMENT")
            _libs.append(lib)
        lib.define(schema)
        lib.impl(name, fn, "CompositeExplicitAutograd")
        done.append(f"{ns}::{name}")
    return done


def patch_interpreter_bf16_dot() -> bool:
    """Triton's interpreter stores bfloat16 as uint16 and its create_dot converts only 8-bit
    float operands, so a bf16 tl.dot multiplies bit patterns (triton-lang/triton#11584, closed
    unfixed: "we just don't support it yet"). Convert bf16 operands to float32 first, the way
    the interpreter's own cast path does. Test-process only."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_dot, "_arfuse_bf16", False):
        return False
    orig = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            def f32(h):
                if h.dtype == tl.bfloat16:
                    # bf16 bits are the high half of the float32 bits: exact.
                    bits = np.ascontiguousarray(h.data).view(np.uint16).astype(np.uint32) << 16
                    return ti.TensorHandle(bits.view(np.float32), tl.float32)
                return h
            a, b = f32(a), f32(b)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._arfuse_bf16 = True
    builder.create_dot = create_dot
    return True


def patch_interpreter_float_casts() -> bool:
    """Triton's interpreter converts float32 -> bfloat16 by truncation (cast_impl passes no
    rounding mode to _convert_float) and its 'RTNE' path rounds half up without carrying into
    the exponent; the GPU converts with round-to-nearest-even. Route narrowing float casts
    through torch (RNE). Test-process only."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder.cast_impl, "_arfuse_rne", False):
        return False
    TORCH = {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16,
             tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    NP_BITS = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.float16,
               torch.float8_e4m3fn: np.uint8, torch.float8_e5m2: np.uint8}
    VIEW = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8,
            torch.float8_e5m2: torch.uint8}

    def convert(src, dst_type):
        s, d = TORCH.get(src.dtype.scalar), TORCH.get(dst_type.scalar)
        if s is None or d is None or s == d:
            return None
        if torch.finfo(d).bits >= torch.finfo(s).bits:
            return None  # widening is exact in the interpreter
        data = np.ascontiguousarray(src.data)
        t = torch.from_numpy(data.view(np.int16) if s == torch.bfloat16 else
                             data.view(np.uint8) if s in (torch.float8_e4m3fn, torch.float8_e5m2)
                             else data)
        if s in VIEW:
            t = t.view(s)
        out = t.to(d)
        out = out.view(VIEW[d]) if d in VIEW else out
        arr = out.numpy().view(NP_BITS[d])
        return ti.TensorHandle(arr, dst_type.scalar)

    orig_cast, orig_fp = builder.cast_impl, builder.create_fp_to_fp

    def cast_impl(self, src, dst_type):
        r = convert(src, dst_type)
        return r if r is not None else orig_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        r = convert(src, dst_type)
        return r if r is not None else orig_fp(self, src, dst_type, rounding_mode)

    cast_impl._arfuse_rne = True
    builder.cast_impl = cast_impl
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder.create_fp_to_fp = create_fp_to_fp
    return True


def topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output, renormalize,
                 bias=None, is_padding=None):
    _count("topk_softmax")
    scores = torch.softmax(gating_output.float(), dim=-1)
    sel = scores + bias.float() if bias is not None else scores
    idx = torch.topk(sel, topk_weights.shape[1], dim=-1).indices
    w = scores.gather(1, idx)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    if is_padding is not None:
        idx = torch.where(is_padding[: idx.shape[0]].unsqueeze(1), -1, idx)
    topk_weights.copy_(w)
    topk_indices.copy_(idx.to(topk_indices.dtype))
    t = torch.arange(idx.shape[0]).unsqueeze(1)
    k = torch.arange(idx.shape[1]).unsqueeze(0)
    token_expert_indices.copy_((k * idx.shape[0] + t).to(token_expert_indices.dtype))


def register_routing(vllm_version: str) -> list[str]:
    """Every stand-in, topk_softmax with the schema of this release (0.27 added is_padding)."""
    major, minor = (int(x) for x in vllm_version.split(".")[:2])
    sch = ("topk_softmax(Tensor! topk_weights, Tensor! topk_indices, Tensor! "
           "token_expert_indices, Tensor gating_output, bool renormalize, Tensor? bias")
    sch += ", Tensor? is_padding) -> ()" if (major, minor) >= (0, 27) else ") -> ()"
    SCHEMAS[("_moe_C", "topk_softmax")] = (sch, topk_softmax)
    return register()


def setup(vllm_version: str) -> dict[str, object]:
    """The stand-ins and the interpreter patches; refuses to run without the interpreter."""
    import os

    from triton.runtime import interpreter as ti

    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing"
    done = {"standins": register_routing(vllm_version),
            "bf16_dot": patch_interpreter_bf16_dot(),
            "rne_casts": patch_interpreter_float_casts()}
    builder = getattr(ti, "InterpreterBuilder", None)
    # Fail loudly where Triton's interpreter moved: the patches would silently not apply.
    assert builder is not None and getattr(builder.create_dot, "_arfuse_bf16", False), \
        "Triton's interpreter has no patchable InterpreterBuilder.create_dot"
    assert getattr(builder.cast_impl, "_arfuse_rne", False), \
        "Triton's interpreter has no patchable InterpreterBuilder.cast_impl"
    return done
