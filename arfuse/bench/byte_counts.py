"""Byte counts for ``python -m arfuse.bench`` (pure Python arithmetic, no GPU).

Every count is **per call and per rank**: the bytes one rank's kernel(s) read and write in global
memory (its own HBM and, over NVLink, its peers' buffers). Notation:

    T   tokens                     H   hidden size                N   world size (ranks)
    K   experts per token (top_k)  e   bytes per activation element (bf16/fp16 2, fp32 4)
    w   bytes per router weight (4 for float32 weights, e for weights in the activation dtype)
    g   bytes per gamma element (e unless gamma is float32)
    R   expert rows actually read: T*K (dense), the number of indices >= 0 (permuted), T (plain)

Finalize input, read once by whichever kernel does the finalize (F_in)::

    F_in = R*H*e                      expert rows
         + T*K*w                      router weights          (dense, permuted)
         + T*K*4                      int32 permuted indices  (permuted only)
         + T*H*e                      shared-expert partial   (when a shared output is given)

plain layout: R = T, no weights, no indices.

One-shot (every rank pushes its partial rows to every peer, each rank sums all N)::

    oneshot = F_in
            + N*T*H*e     partial written to the N ranks' buffers (own buffer included)
            + N*T*H*e     the N partials read back from this rank's buffer
            + N*T*H*e     resets to the sentinel (each vector right after it is read)
            + T*H*e       residual read
            + H*g         gamma read
            + 2*T*H*e     residual_out and norm_out written
            = F_in + 3*N*T*H*e + 3*T*H*e + H*g

Two-shot (reduce-scatter by token rows, then all-gather of the reduced rows, norm after the
gather), as csrc/arfuse/kernel.cuh does it: the owner of a token adds the residual, pushes
residual_out to its peers' gather areas and writes both outputs of its own tokens; every rank then
reads the gathered rows of the other owners' tokens and writes both outputs of them. The owner's
own partials and its own gathered rows never go through its buffer (registers). Rank r owns
ceil(T/N) tokens (the last ranks fewer); the terms marked (avg) are exact averages over ranks,
with T/N the average number of tokens a rank owns::

    twoshot = F_in
            + (T - T/N)*H*e       scatter: the partials of the other owners' tokens, to them (avg)
            + (N-1)*(T/N)*H*e     owner reads its peers' partials of its rows       (avg)
            + (T/N)*H*e           owner reads the residual of its rows              (avg)
            + (N-1)*(T/N)*H*e     gather: owner writes its residual_out rows to N-1 peers (avg)
            + (T - T/N)*H*e       gather reads: the rows of the other owners' tokens (avg)
            + 2*(T - T/N)*H*e     resets to the sentinel after reading (scatter + gather area)
            + H*g                 gamma read
            + 2*T*H*e             residual_out and norm_out written
            = F_in + 8*T*H*e - 5*(T/N)*H*e + H*g

Local (world size 1, no all-reduce: finalize, residual and norm of each token in one pass)::

    local = F_in
          + T*H*e       residual read
          + H*g         gamma read
          + 2*T*H*e     residual_out and norm_out written
          = F_in + 3*T*H*e + H*g

Unfused pipeline (standalone ``arfuse.moe_finalize`` kernel, then the plain-layout op)::

    unfused = (F_in + T*H*e)                     finalize: rows etc. read, [T, H] written
            + op(plain, F_in = T*H*e, algorithm)  the all-reduce + residual + RMSNorm kernel

"vLLM today" on vLLM's router-weighted dense rows (``vllm_today``: dense layout, no weights, w = 0)::

    vllm_today = T*K*H*e + T*H*e                 moe_sum: rows read, [T, H] written
               + 2*T*H*e                         the copy into the layer's output
               + 3*T*H*e   (shared expert)       shared + rsf * y: two reads, one write
                 or 2*T*H*e (rsf != 1 only)      rsf * y
                 or 0       (neither)
               + op(plain, F_in = T*H*e, algorithm)

At world size 1 the last step is the plain local op, i.e. exactly vLLM's ``fused_add_rms_norm``
(x and residual read, both written, gamma read). ``vllm_ops`` is the same pipeline run by vLLM's
own kernels (``_moe_C.moe_sum``, the copy, the shared add, ``_C.fused_add_rms_norm``): the same
bytes as ``vllm_today`` at world size 1.

Emulated groups (``--emulate``) run all N ranks on one GPU, sharing one HBM: the bench reports
per-rank bytes * N over the per-call time as achieved bandwidth. Under torchrun each rank has its
own GPU: per-rank bytes over the per-call time.

The PyTorch composition is a chain of many generic ops with intermediate tensors; its bytes are
not counted (reported as empty).
"""

from __future__ import annotations

from .._vocab import KERNEL_ALGORITHMS, LOCAL_ALGORITHMS

LAYOUTS = ("permuted", "dense", "plain")
ALGORITHMS = KERNEL_ALGORITHMS + LOCAL_ALGORITHMS  # ("oneshot", "twoshot", "local")


def _check(layout: str, T: int, H: int, K: int, N: int) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    for name, v in (("tokens", T), ("hidden", H), ("top_k", K), ("world_size", N)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def rows_read(layout: str, T: int, K: int, valid_rows: int | None = None) -> int:
    """R: expert rows read per rank. ``valid_rows`` (indices >= 0) is used for the permuted
    layout; without it all T*K rows are assumed present."""
    if layout == "plain":
        return T
    if layout == "permuted" and valid_rows is not None:
        if not 0 <= valid_rows <= T * K:
            raise ValueError(f"valid_rows={valid_rows} outside [0, T*K={T * K}]")
        return int(valid_rows)
    return T * K


def finalize_input_bytes(layout: str, T: int, H: int, K: int, elem: int, *,
                         valid_rows: int | None = None, weight_elem: int = 4,
                         shared: bool = True) -> dict[str, int]:
    """F_in, itemised: {'expert_rows', 'weights', 'indices', 'shared'}."""
    _check(layout, T, H, K, 1)
    R = rows_read(layout, T, K, valid_rows)
    out = {"expert_rows": R * H * elem, "weights": 0, "indices": 0, "shared": 0}
    if layout in ("dense", "permuted"):
        out["weights"] = T * K * weight_elem
    if layout == "permuted":
        out["indices"] = T * K * 4
    if shared:
        out["shared"] = T * H * elem
    return out


def op_bytes_breakdown(algorithm: str, layout: str, T: int, H: int, K: int, N: int, elem: int,
                       *, valid_rows: int | None = None, weight_elem: int = 4,
                       shared: bool = True, gamma_elem: int | None = None) -> dict[str, int]:
    """Per-rank bytes of one fused call (finalize + all-reduce + residual + RMSNorm), itemised."""
    _check(layout, T, H, K, N)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    if (algorithm in LOCAL_ALGORITHMS) != (N == 1):
        raise ValueError(f"algorithm {algorithm!r} does not serve world size {N} "
                         "(local is world size 1's, and only local is)")
    g = elem if gamma_elem is None else gamma_elem
    b = finalize_input_bytes(layout, T, H, K, elem, valid_rows=valid_rows,
                             weight_elem=weight_elem, shared=shared)
    row = T * H * elem
    if algorithm in LOCAL_ALGORITHMS:
        b["residual"] = row
    elif algorithm == "oneshot":
        b["push"] = N * row
        b["peer_reads"] = N * row
        b["clear"] = N * row
        b["residual"] = row
    else:
        own = (row + N // 2) // N                 # (T/N) * H * e: a rank's own rows (avg)
        peers = row - own                         # (T - T/N) * H * e = (N-1) * (T/N) * H * e
        b["scatter"] = peers
        b["owner_reads"] = peers
        b["residual"] = own
        b["gather_writes"] = peers
        b["gather_reads"] = peers
        b["clear"] = 2 * peers
    b["gamma"] = H * g
    b["outputs"] = 2 * row
    return b


def op_bytes(algorithm: str, layout: str, T: int, H: int, K: int, N: int, elem: int,
             **kw) -> int:
    """Per-rank bytes of one fused call; see the module docstring for the formula."""
    return sum(op_bytes_breakdown(algorithm, layout, T, H, K, N, elem, **kw).values())


def unfused_bytes(algorithm: str, layout: str, T: int, H: int, K: int, N: int, elem: int, *,
                  valid_rows: int | None = None, weight_elem: int = 4, shared: bool = True,
                  gamma_elem: int | None = None) -> int:
    """Per-rank bytes of the unfused pipeline: standalone finalize (reads F_in, writes T*H*e),
    then the plain-layout op (``algorithm`` is the one it dispatched to)."""
    fin = sum(finalize_input_bytes(layout, T, H, K, elem, valid_rows=valid_rows,
                                   weight_elem=weight_elem, shared=shared).values())
    fin += T * H * elem
    return fin + op_bytes(algorithm, "plain", T, H, 1, N, elem, shared=False,
                          gamma_elem=gamma_elem)


def vllm_today_bytes(algorithm: str, T: int, H: int, K: int, N: int, elem: int, *,
                     shared: bool = True, scaled: bool = False,
                     gamma_elem: int | None = None, **_ignored) -> int:
    """Per-rank bytes of "vLLM today" (module docstring); ``algorithm`` is the one its all-reduce
    + RMSNorm kernel dispatched to."""
    row = T * H * elem
    b = T * K * H * elem + row + 2 * row
    b += 3 * row if shared else (2 * row if scaled else 0)
    return b + op_bytes(algorithm, "plain", T, H, 1, N, elem, shared=False,
                        gamma_elem=gamma_elem)


def resolve_algorithm(algorithm: str, T: int, oneshot_max_tokens: int | None,
                      world_size: int = 2) -> str:
    """What "auto" dispatches to: local at world size 1, else one-shot for T <= the threshold."""
    if algorithm == "auto" and world_size == 1:
        return LOCAL_ALGORITHMS[0]
    if algorithm == "auto":
        return "oneshot" if T <= oneshot_max_tokens else "twoshot"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    return algorithm


# impl name -> (kind, algorithm): kind 'fused' = one fused call, 'unfused' = finalize + plain op,
# None = bytes not counted.
IMPL_ALGORITHM = {
    "arfuse": ("fused", "auto"),
    "arfuse_pdl": ("fused", "auto"),         # the same kernel, launched as a programmatic dependent
    "arfuse_oneshot": ("fused", "oneshot"),
    "arfuse_twoshot": ("fused", "twoshot"),
    "unfused": ("unfused", "auto"),
    "vllm_today": ("vllm_today", "auto"),    # --weights-dtype none: vLLM's moe_sum + copy + ...
    "vllm_ops": ("vllm_today", "auto"),      # the same at world size 1, by vLLM's own kernels
    "torch": (None, None),
    "arfuse_q": ("fused", "auto"),           # --quant: FP8 output written by the fused kernel
    "arfuse_sepq": ("sepquant", "auto"),     # --quant: activation-dtype output + quant kernel
    "flashinfer_p7": ("fused", "oneshot"),   # FlashInfer's MoE-finalize fusion is one-shot only
    "flashinfer_p1": ("unfused", "auto"),    # arfuse.moe_finalize + FlashInfer pattern 1
}


def impl_bytes(impl: str, layout: str, T: int, H: int, K: int, N: int, elem: int, *,
               oneshot_max_tokens: int | None = None, algorithm: str | None = None,
               **kw) -> int | None:
    """Per-rank bytes of one call of a benchmarked implementation (None: not counted).

    ``algorithm`` overrides the table (what the implementation actually ran); "auto" resolves
    with ``oneshot_max_tokens`` (None: unknown, bytes not counted)."""
    kind, algo = IMPL_ALGORITHM.get(impl, (None, None))
    if kind is None:
        return None
    algo = algorithm or algo
    if algo == "auto":
        if oneshot_max_tokens is None and N != 1:
            return None
        algo = resolve_algorithm(algo, T, oneshot_max_tokens, N)
    quant = kw.pop("quant", None)
    if kind == "fused":
        return op_bytes(algo, layout, T, H, K, N, elem, **kw) + quant_output_delta(quant, T, H, elem)
    if kind == "sepquant":  # the op with activation-dtype output, then a quantization kernel
        return op_bytes(algo, layout, T, H, K, N, elem, **kw) + separate_quant_bytes(quant, T, H, elem)
    if kind == "vllm_today":
        return vllm_today_bytes(algo, T, H, K, N, elem, **kw)
    kw.pop("scaled", None)
    return unfused_bytes(algo, layout, T, H, K, N, elem, **kw)


def scale_bytes(quant: str | None, T: int, H: int) -> int:
    """float32 scales written by a quantized output: none (static), [T] (per token) or
    [T, H/128] (per group of 128)."""
    if quant in (None, "fp8_static"):
        return 0
    if quant == "fp8_token":
        return 4 * T
    if quant == "fp8_group128":
        return 4 * T * (H // 128)
    raise ValueError(f"unknown quant {quant!r}")


def quant_output_delta(quant: str | None, T: int, H: int, elem: int) -> int:
    """Fused FP8 output: norm_out is written as 1-byte codes instead of elem-byte values, plus the
    scales."""
    if quant is None:
        return 0
    return T * H * (1 - elem) + scale_bytes(quant, T, H)


def separate_quant_bytes(quant: str | None, T: int, H: int, elem: int) -> int:
    """A separate quantization kernel after an activation-dtype norm_out: reads it (T*H*e),
    writes the codes (T*H) and the scales (static: reads the one scale, 4 bytes)."""
    if quant is None:
        raise ValueError("separate_quant_bytes needs a quant kind")
    return T * H * elem + T * H + scale_bytes(quant, T, H) + (4 if quant == "fp8_static" else 0)


def input_set_bytes(layout: str, T: int, H: int, K: int, elem: int, *, weight_elem: int = 4,
                    shared: bool = True) -> int:
    """Bytes allocated for one rank's input set (expert_out, indices, weights, shared, residual):
    what rotating input sets must spread over to keep the data out of L2."""
    _check(layout, T, H, K, 1)
    rows = T if layout == "plain" else T * K
    b = rows * H * elem + T * H * elem  # expert_out, residual
    if layout in ("dense", "permuted"):
        b += T * K * weight_elem
    if layout == "permuted":
        b += T * K * 4
    if shared:
        b += T * H * elem
    return b


# The default cap on input sets: keeps even the smallest set (16 KiB: T = 1, H = 2048, N = 2,
# plain layout, no shared row) above 4x a 50 MiB L2.
MAX_SETS = 16384


def num_input_sets(set_bytes: int, l2_bytes: int, *, factor: float = 4.0, min_sets: int = 2,
                   max_sets: int = MAX_SETS) -> int:
    """Distinct input sets so that together they exceed ``factor`` x L2 (at least ``min_sets``
    so that consecutive calls differ, at most ``max_sets``)."""
    if set_bytes <= 0:
        raise ValueError("set_bytes must be positive")
    need = int(factor * l2_bytes) // int(set_bytes) + 1  # smallest n with n * set_bytes > factor * L2
    return max(min_sets, min(max_sets, need))


def replay_plan(n_sets: int, graph_calls: int, replays: int) -> tuple[int, int]:
    """(graphs, timed replays) for ``n_sets`` input sets and ``graph_calls`` calls per graph: graph g
    uses sets g*G .. g*G+G-1 (mod n_sets), and the timed replays, round-robin over the graphs,
    are at least ``replays`` and at least one per graph, so that what they read is the whole
    rotation and not only the part the first ``replays`` graphs touch (which was L2-resident for
    small sets: 50 replays x 24 calls of 2,048 sets of 16 KiB read 19 MiB)."""
    if n_sets < 1 or graph_calls < 1 or replays < 1:
        raise ValueError("n_sets, graph_calls and replays must be >= 1")
    graphs = -(-n_sets // graph_calls)
    return graphs, max(replays, graphs)


def graph_calls_for(T: int, graph_calls: int, *, full_until: int = 128) -> int:
    """Calls captured per graph at T tokens: ``graph_calls`` up to ``full_until`` tokens (where a
    call is a few microseconds and launch gaps would show), then fewer in proportion, at least 2
    (consecutive calls still use different input sets). A graph of 20 calls at 8192 tokens holds
    20 calls' outputs in its memory pool (tens of GB for 8 emulated ranks) and takes seconds per
    replay; at those sizes a call lasts hundreds of microseconds and launch gaps do not show."""
    if graph_calls < 1:
        raise ValueError(f"graph_calls must be >= 1, got {graph_calls}")
    if T <= full_until:
        return graph_calls
    return max(min(2, graph_calls), graph_calls * full_until // T)
