"""The cases of ``arfuse.check``, by suite: the one-shot/two-shot GPU suites' cases at the world size
of the run (the build's specialised instances, token counts, input forms, generic sizes, special
values, in place, one-shot = two-shot, FP8, no residual), each with its seed."""

from __future__ import annotations

import dataclasses
import json
import zlib


SUITES = ("specialised", "token_counts", "forms", "generic", "specials", "inplace",
          "oneshot_twoshot", "fp8_static", "no_residual", "graph")

DEFAULT_MAX_TOKENS = 256
FP8_SCALE = 0.02

# Shapes (hidden, dtype) per suite: the full run, then --quick.
SHAPES = {
    "token_counts": ([(7168, "bf16"), (4096, "bf16"), (2880, "bf16"), (2048, "bf16"),
                      (4096, "fp16")], [(2048, "bf16")]),
    "forms": ([(4096, "fp16"), (2048, "bf16"), (1536, "fp32")], [(2048, "bf16")]),
    "generic": ([(2880, "bf16"), (1536, "bf16"), (6400, "bf16"), (2880, "fp16"), (5120, "fp16"),
                 (7168, "fp32"), (2880, "fp32"), (1000, "fp16"), (24576, "bf16")],
                [(2880, "fp16"), (1536, "fp32")]),
    "specials": ([(7168, "bf16"), (2880, "fp16"), (1536, "fp32")], [(2048, "bf16"), (1536, "fp32")]),
    "inplace": ([(7168, "bf16"), (2880, "bf16")], [(2048, "bf16")]),
    "oneshot_twoshot": ([(7168, "bf16"), (4096, "fp16"), (2880, "bf16"), (1536, "fp32")],
                        [(2048, "bf16")]),
    "fp8_static": ([(2880, "bf16"), (7168, "bf16"), (2048, "bf16")], [(2048, "bf16")]),
    "no_residual": ([(7168, "bf16"), (2880, "fp16")], [(2048, "bf16")]),
    "graph": ([(4096, "fp16")], [(4096, "fp16")]),
}


@dataclasses.dataclass
class DistCase:
    suite: str
    case: object            # arfuse._checks.Case
    kind: str = "fused"     # fused | inplace | no_residual | oneshot_twoshot
    fp8_scale: float | None = None

    @property
    def name(self) -> str:
        return f"{self.suite}:{self.case}"

    @property
    def algorithms(self) -> list[str]:
        """The calls the case makes, in order."""
        if self.kind == "oneshot_twoshot":
            return ["oneshot", "twoshot"]
        return [self.case.algorithm]


def token_counts(max_tokens: int) -> list[int]:
    return sorted({t for t in (0, 1, 3, 17, 128, max_tokens) if t <= max_tokens})


def specialised_from_manifest(path, world: int) -> list[tuple[str, int]]:
    """(dtype name, hidden) of every specialised norm instance of `world` in a build manifest."""
    try:
        with open(path) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return []
    seen = set()
    for inst in m.get("instances", []):
        if (inst.get("hidden") and inst.get("world_size") == world
                and inst.get("output", inst.get("out", "norm")) == "norm"):
            seen.add((inst["dtype"], int(inst["hidden"])))
    return sorted(seen)


def build_cases(world: int, *, quick: bool = False, max_tokens: int = DEFAULT_MAX_TOKENS,
                specialised=(), suites=SUITES) -> list[DistCase]:
    """The cases of the GPU suites for a world size, in a fixed order (every rank builds the same
    list). The graph check is not a case (see run_graph)."""
    from .._checks import OPTION_CASES, Case  # OPTION_CASES: the GPU suite's input forms
    from .._vocab import DTYPES, algorithms_for

    def shapes(suite):
        return SHAPES[suite][1 if quick else 0]

    def T(t):
        return min(t, max_tokens)

    N = world
    ALGOS = algorithms_for(N)  # world size 1: local (no all-reduce), else one-shot and two-shot
    out: list[DistCase] = []
    if "specialised" in suites:
        specs = list(specialised)[:1] if quick else list(specialised)
        for d, hidden in specs:
            for algo in ALGOS:
                out.append(DistCase("specialised", Case(N, hidden, DTYPES[d], T(17), "dense", 8,
                                                        "f32", True, 2.5, algorithm=algo)))
                out.append(DistCase("specialised", Case(N, hidden, DTYPES[d], T(128), "permuted",
                                                        8, "act", True, 1.0, weight_bias=1.0,
                                                        absent=0.3, algorithm=algo)))
    if "token_counts" in suites:
        for hidden, d in shapes("token_counts"):
            for t in token_counts(max_tokens):
                for algo in (*ALGOS, "auto"):
                    out.append(DistCase("token_counts", Case(N, hidden, DTYPES[d], t, "permuted",
                                                             8, "f32", True, 1.0, absent=0.25,
                                                             algorithm=algo)))
    if "forms" in suites:
        for hidden, d in shapes("forms"):
            for layout, k, w, sh, rs, wb, g32, absent in OPTION_CASES:
                for algo in ALGOS:
                    out.append(DistCase("forms", Case(N, hidden, DTYPES[d], T(33), layout, k, w,
                                                      sh, rs, wb, g32, absent, algorithm=algo)))
    if "generic" in suites:
        for hidden, d in shapes("generic"):
            for algo in ALGOS:
                out.append(DistCase("generic", Case(N, hidden, DTYPES[d], T(40), "dense", 4, "f32",
                                                    True, 1.0, algorithm=algo)))
    if "specials" in suites and max_tokens >= 3:
        for hidden, d in shapes("specials"):
            for layout in ("plain", "dense", "permuted"):
                for algo in ALGOS:
                    out.append(DistCase("specials", Case(
                        N, hidden, DTYPES[d], T(9), layout, 1 if layout == "plain" else 4,
                        None if layout == "plain" else "f32", True, 1.0, specials=True,
                        absent=0.2 if layout == "permuted" else 0, algorithm=algo)))
    if "inplace" in suites:
        for hidden, d in shapes("inplace"):
            for algo in ALGOS:
                out.append(DistCase("inplace", Case(N, hidden, DTYPES[d], T(64), "plain", 1, None,
                                                    True, 1.0, inplace=True, algorithm=algo),
                                    kind="inplace"))
    if "oneshot_twoshot" in suites and N > 1:
        for hidden, d in shapes("oneshot_twoshot"):
            out.append(DistCase("oneshot_twoshot", Case(N, hidden, DTYPES[d], T(77), "permuted",
                                                        8, "f32", True, 2.5, absent=0.3,
                                                        algorithm="oneshot"),
                                kind="oneshot_twoshot"))
    if "fp8_static" in suites:
        for hidden, d in shapes("fp8_static"):
            for algo in ALGOS:
                out.append(DistCase("fp8_static", Case(N, hidden, DTYPES[d], T(50), "permuted", 8,
                                                       "f32", True, 1.0, absent=0.2, fp8=True,
                                                       algorithm=algo), fp8_scale=FP8_SCALE))
    if "no_residual" in suites:
        for hidden, d in shapes("no_residual"):
            for algo in ALGOS:
                out.append(DistCase("no_residual", Case(N, hidden, DTYPES[d], T(21), "plain", 1,
                                                        None, True, 1.0, algorithm=algo),
                                    kind="no_residual"))
    return out


def case_seed(base: int, name: str) -> int:
    return (base + zlib.crc32(name.encode())) % (1 << 31)
