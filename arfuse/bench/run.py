"""The benchmark's run (``arfuse.bench.run.run``, called by the command line when a run starts; it
imports torch and arfuse): every implementation at every token count -- inputs, the correctness
guard, timing -- with progress, failure recovery and the result rows."""

from __future__ import annotations

import gc
import math
import sys

import torch

from . import byte_counts as BB
from . import report as BR
from .group import Setup, close_setup, heal, make_setup, oneshot_threshold
from .impls import QUANT_IMPLS, QUANT_TOLERANCE, Skip, build_impl
from .inputs import TOLERANCE, add_flashinfer_views, make_sets, mean_valid_rows, reference
from .timing import check_local, copy_bandwidth, time_impl


class Progress:
    def __init__(self, total: int, enabled: bool):
        self.enabled, self.total, self.i, self.bar = enabled, total, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def step(self, desc: str, result: str = ""):
        self.i += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description(desc)
            if result:
                self.bar.set_postfix_str(result)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {desc} {result}", file=sys.stderr, flush=True)

    def write(self, msg: str):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _cuda_alive(device) -> bool:
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:
        return False


def run(args, on_token_done=None, factories=None) -> dict:
    """Time every implementation at every token count. Returns a dict: rows, copy_gbps,
    oneshot_max_tokens, notes, checks, failed_check, aborted, is_main, l2_bytes, card,
    flashinfer, flashinfer_api. ``factories``: more implementations, name -> f(setup, sets, T)
    returning an Impl (arfuse.bench.ladder's rungs); an Impl whose ``check`` is False computes
    nothing checkable and is timed without the correctness guard."""
    setup = make_setup(args)
    try:
        return _run(setup, on_token_done, factories or {})
    finally:
        close_setup(setup)


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def _run(setup: Setup, on_token_done=None, factories=None) -> dict:
    a = setup.args
    notes = setup.notes
    if getattr(setup.args, "shared_gpu", False):
        notes.append(f"ranks sharing one GPU ({setup.args.device}, {setup.world_size} processes): "
                     "a test mode, NOT the speed of a tensor-parallel group; the unfused "
                     "pipeline is not run (NCCL needs one GPU per rank)")
    copy_gbps = copy_bandwidth(setup.device, a.copy_mb)
    thr = oneshot_threshold(setup)
    if thr is None:
        notes.append("arfuse.oneshot_threshold missing: auto/unfused bytes not counted")
    props = torch.cuda.get_device_properties(setup.device)
    l2 = int(a.l2_mb * (1 << 20)) if a.l2_mb else int(getattr(props, "L2_cache_size", 0) or
                                                       60 * (1 << 20))
    tol = TOLERANCE[a.dtype]
    impls = list(a.impls)
    fi_asked = [i for i in impls if i.startswith("flashinfer")]
    if fi_asked and (setup.emulated or setup.fi is None):
        impls = [i for i in impls if i not in fi_asked]
        if setup.emulated:
            notes.append("FlashInfer not benchmarked: it needs torchrun (one GPU per rank)")
        # else make_setup already said why
    if "flashinfer_p7" in impls and a.layout == "plain":
        impls.remove("flashinfer_p7")
        notes.append("FlashInfer pattern 7 not benchmarked: it needs expert rows "
                     "(permuted or dense layout)")
    rows, checks, failed, aborted = [], [], [], None
    prog = Progress(len(a.tokens) * len(impls), setup.is_main)
    if setup.is_main:
        mode = (f"emulated, {setup.world_size} ranks on one GPU" if setup.emulated
                else f"torchrun, {setup.world_size} GPUs")
        prog.write(f"arfuse.bench: {torch.cuda.get_device_name(setup.device)}, {mode}; "
                   f"copy bandwidth {copy_gbps:,.0f} GB/s; L2 {l2 >> 20} MiB; "
                   f"one-shot for T <= {thr}")
    kw_bytes = dict(weight_elem=(0 if a.weights_dtype == "none" else
                                 torch.empty((), dtype=setup.weight_dtype).element_size()),
                    shared=a.shared)
    try:
        for T in a.tokens:
            set_bytes = BB.input_set_bytes(a.layout, T, a.hidden, a.topk, setup.elem,
                                           **kw_bytes) * len(setup.ranks)
            n_sets = BB.num_input_sets(set_bytes, l2, max_sets=a.max_sets)
            G = BB.graph_calls_for(T, a.graph_calls)
            sets = ref = None
            try:
                sets = make_sets(setup, T, n_sets)
                if setup.fi is not None:
                    add_flashinfer_views(setup, sets)
                valid = mean_valid_rows(sets)
                ref = reference(setup, sets[0])
                local_msg = None
            except torch.cuda.OutOfMemoryError as e:  # this T does not fit: say so, go on
                local_msg = _first_line(e)
            if setup.max_over_ranks([1.0 if local_msg else 0.0])[0]:
                for name in impls:
                    rows.append(BR.new_row(name, T, input_sets=n_sets, note="inputs or "
                                           "reference: " + (local_msg or "failed on another rank")))
                    prog.step(f"T={T} {name}", "OOM")
                del sets, ref
                gc.collect()
                torch.cuda.empty_cache()
                continue
            for name in impls:
                row = BR.new_row(name, T, replays=a.replays, graph_calls=G, input_sets=n_sets)
                result, impl = "", None
                try:
                    impl = (factories[name](setup, sets, T) if name in (factories or {})
                            else build_impl(name, setup, sets, T, thr))
                except Skip as e:  # deterministic: the same on every rank
                    row["note"], result = str(e), "skip"
                if impl is not None:
                    row["algorithm"] = impl.algorithm or ("auto" if name in ("arfuse", "arfuse_pdl")
                                                          else None)
                    # --producer: the time holds the producer's copy too, so no bandwidth figure
                    row["bytes_per_rank"] = None if a.producer else BB.impl_bytes(
                        name, a.layout, T, a.hidden, a.topk, setup.world_size, setup.elem,
                        oneshot_max_tokens=thr, algorithm=impl.algorithm, valid_rows=valid,
                        quant=(a.quant if name in QUANT_IMPLS else None),
                        **({"scaled": float(a.routed_scaling) != 1.0}
                           if name in ("vllm_today", "vllm_ops") else {}), **kw_bytes)
                    # guard rail: one call against the float32 reference (collective status)
                    local_msg = None
                    try:
                        err = check_local(setup, impl, ref) if getattr(impl, "check", True) \
                            else 0.0
                    except Exception as e:
                        err, local_msg = math.inf, _first_line(e)
                    fail, err = setup.max_over_ranks([1.0 if local_msg else 0.0, err])
                    if fail:
                        row["note"] = "failed: " + (local_msg or "on another rank")
                        result = "FAILED"
                    else:
                        row["max_rel_err"] = err
                        tol_i = QUANT_TOLERANCE if name in QUANT_IMPLS else \
                            tol * getattr(impl, "TOLERANCE_FACTOR", 1)
                        checks.append({"impl": name, "tokens": T, "max_rel_err": err,
                                       "tol": tol_i})
                        if not err <= tol_i:
                            row["note"] = (f"wrong result: max rel err {err:.3g} > {tol_i:g} "
                                           "vs the float32 reference; not timed")
                            failed.append({"impl": name, "tokens": T, "max_rel_err": err})
                            result = "WRONG"
                    if not result:
                        local_msg, mode = None, a.timing
                        try:
                            ms, mode = time_impl(setup, impl, n_sets, G)
                        except Exception as e:
                            ms, local_msg = [0.0] * a.replays, _first_line(e)
                        agg = setup.max_over_ranks([1.0 if local_msg else 0.0] + list(ms))
                        if agg[0]:
                            row["note"] = "timing failed: " + (local_msg or "on another rank")
                            result = "FAILED"
                        else:
                            row.update(BR.summarize([t * 1e3 / G for t in agg[1:]]))
                            row["replays"] = row.pop("n")  # at least --replays (time_impl)
                            row["timing"] = mode
                            result = f"{row['median_us']:.2f} us"
                rows.append(row)
                del impl
                prog.step(f"T={T} {name}", result)
                if result in ("FAILED", "WRONG"):
                    if not _cuda_alive(setup.device):
                        aborted = f"CUDA context lost at T={T} {name} ({row['note']}); run stopped"
                        break
                    try:
                        if heal(setup):
                            prog.write(f"T={T} {name}: a call timed out; communicators recreated")
                    except Exception as e:
                        aborted = f"could not recreate the communicators: {_first_line(e)}"
                        break
            del sets, ref
            gc.collect()
            torch.cuda.empty_cache()
            if on_token_done is not None and setup.is_main:
                on_token_done(rows)
            if aborted:
                break
    finally:
        prog.close()
    if aborted:
        notes.append(aborted)
    return {"rows": rows, "copy_gbps": copy_gbps, "oneshot_max_tokens": thr, "notes": notes,
            "checks": checks, "failed_check": failed, "aborted": aborted,
            "is_main": setup.is_main, "l2_bytes": l2,
            "card": torch.cuda.get_device_name(setup.device),
            "flashinfer": getattr(setup.fi, "version", None),
            "flashinfer_api": getattr(setup.fi, "kind", None)}
