"""The files a benchmark run writes, named by its arguments: the CSV, the markdown table, the JSON of
the environment and the command (with the tuning row under --tune, also as YAML), and the plot."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from . import report as BR
from .._tools.provenance import run_info


def output_stem(ns) -> str:
    if ns.name:
        return ns.name
    what = ns.model_name or f"h{ns.hidden}k{ns.topk}"
    kind = "tune" if ns.tune else "bench"
    mode = "emu" if ns.emulate else ("shared" if _shared(ns) else "tp")
    quant = f"_{ns.quant}" if getattr(ns, "quant", None) else ""
    return f"{kind}_{what}_{mode}{ns.world_size}_{ns.dtype}_{ns.layout}{quant}"


def _shared(ns) -> bool:
    """Ranks as processes sharing one GPU (torchrun with --device cuda:K): a test mode."""
    return bool(getattr(ns, "shared_gpu", False))


def title(ns, card: str) -> str:
    what = f"{ns.model_name} " if ns.model_name else ""
    mode = ("emulated on one GPU" if ns.emulate else
            "ranks sharing one GPU, a test mode" if _shared(ns) else "one GPU per rank")
    quant = f", {ns.quant} output" if getattr(ns, "quant", None) else ""
    return (f"arfuse: {what}H={ns.hidden} K={ns.topk} N={ns.world_size} {ns.dtype} "
            f"{ns.layout}{quant} ({mode}) — {card}")


def command_line(ns, argv) -> str:
    launcher = (["python", "-m", "arfuse.bench"] if ns.emulate else
                ["torchrun", f"--nproc-per-node={ns.world_size}", "-m", "arfuse.bench"])
    return " ".join(shlex.quote(a) for a in [*launcher, *argv])


def environment(ns, res: dict, argv) -> dict:
    env = run_info(command_line(ns, argv))
    env.update({
        "card": res.get("card"),
        "mode": "emulated" if ns.emulate else "torchrun",
        "world_size": ns.world_size,
        "copy_gbps": res.get("copy_gbps"),
        "l2_bytes": res.get("l2_bytes"),
        "oneshot_max_tokens": res.get("oneshot_max_tokens"),
        "flashinfer": res.get("flashinfer"),
        "flashinfer_api": res.get("flashinfer_api"),
        "args": {k: v for k, v in vars(ns).items() if not k.startswith("_")},
        "checks": res.get("checks", []),
        "failed_checks": res.get("failed_check", []),
        "notes": res.get("notes", []),
        "aborted": res.get("aborted"),
    })
    return env


def header_notes(ns, res: dict) -> list[str]:
    notes = [f"Card: {res.get('card')}. CUDA-graph replay ({ns.graph_calls} calls per graph up to "
             f"128 tokens, proportionally fewer above, at least 2; "
             f"{ns.replays} timed replays); inputs rotated over sets exceeding 4x L2. "
             f"Layout {ns.layout}" + (f", {ns.absent_frac:.0%} of indices -1" if
                                      ns.layout == "permuted" else "") +
             (", shared expert" if ns.shared else "") +
             f", routed_scaling {ns.routed_scaling:g}."]
    if res.get("oneshot_max_tokens") is not None:
        notes.append(f"arfuse auto: one-shot for T <= {res['oneshot_max_tokens']}.")
    notes += [f"Note: {n}" for n in res.get("notes", [])]
    return notes


def write_outputs(ns, res: dict, argv) -> dict[str, Path]:
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(ns)
    rows = BR.finish_rows(res["rows"], copy_gbps=res.get("copy_gbps"),
                          ranks_per_gpu=ns.world_size if ns.emulate else 1)
    paths = {"csv": out / f"{stem}.csv", "md": out / f"{stem}.md", "json": out / f"{stem}.json"}
    BR.write_csv(paths["csv"], rows)
    BR.write_markdown(paths["md"], rows, title=title(ns, res.get("card")),
                      notes=header_notes(ns, res), emulated=ns.emulate,
                      shared_gpu=_shared(ns), world_size=ns.world_size, copy_gbps=res.get("copy_gbps"))
    env = environment(ns, res, argv)
    if ns.tune and not any(r.get("median_us") for r in rows):
        env["tuning"] = {"oneshot_max_tokens": None, "row": None,
                         "warnings": ["nothing was timed: no crossover"]}
    elif ns.tune:
        thr, warns = BR.pick_crossover(rows)
        row = BR.tuning_row(ns.dtype, ns.hidden, ns.world_size, thr)
        env["tuning"] = {"oneshot_max_tokens": thr, "warnings": warns, "row": row}
        paths["yaml"] = out / f"{stem}.yaml"
        with open(paths["yaml"], "w") as f:
            f.write(BR.tuning_yaml(card=res.get("card"), date=env["date"],
                                   commit=env["arfuse_commit"], command=env["command"],
                                   rows=[row], warnings=warns,
                                   mode=(f"emulated, layout {ns.layout}" if ns.emulate
                                         else f"torchrun, layout {ns.layout}")))
    with open(paths["json"], "w") as f:
        json.dump(env, f, indent=2, default=str)
    if ns.plot:
        try:
            paths["png"] = out / f"{stem}.png"
            BR.plot(paths["png"], rows, title=title(ns, res.get("card")))
        except ImportError as e:
            print(f"arfuse.bench: no plot ({e}); install matplotlib or pass --no-plot",
                  file=sys.stderr)
            paths.pop("png")
    return paths
