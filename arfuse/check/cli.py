"""The correctness suite with one process per GPU: ``torchrun -m arfuse.check``.

    torchrun --nproc-per-node 8 -m arfuse.check --out dist-check   # every case, 10,000 replays
    torchrun --nproc-per-node 2 -m arfuse.check --quick             # a subset, 200 replays
    python -m arfuse.check --quick                                  # world size 1 (CPU: the CPU op)

Each process drives one GPU (LOCAL_RANK) with the real ``arfuse.Communicator`` over the default
process group (NCCL on GPUs, gloo on the CPU; ``--backend``), plus a gloo group of its own for the
control messages. The cases are those of the one-shot/two-shot GPU suites (tests/test_gpu_fused.py)
with the world size fixed to the number of processes: the build's specialised instances of that
world size, token counts T in {0, 1, 3, 17, 128, max_tokens} x {oneshot, twoshot, auto}, the input
forms and options (plain / dense / permuted with index -1, K, weights, shared, routed_scaling,
weight_bias, gamma dtype), generic hidden sizes, special values (-0.0, subnormals, NaN, Inf), in
place, one-shot = two-shot, the FP8 static output and no residual; hidden sizes 2048, 2880, 4096
and 7168 among others. For every case:

* every rank draws the inputs of all N ranks from one seed shared by all ranks, and the ranks
  compare a fingerprint of what they drew (a rank that drew other inputs fails the case);
* each rank poisons its outputs (NaN bytes in the very blocks the op then allocates), calls the
  op with its own inputs, and checks every element of its outputs against the float64 reference
  of all N ranks' partials (arfuse._checks: NaN and Inf positions, relative error within 1e-2 /
  2e-3 / 1e-5 for bf16 / fp16 / fp32, FP8 codes within 1 ulp);
* the outputs of all ranks are gathered (all_gather) and compared bit for bit;
* a rank whose communicator reports a timed-out wait, or whose call raised, fails the case and
  the communicator is recreated on every rank.

Then, on GPUs, one call per algorithm (one-shot and two-shot) is captured in a CUDA graph each and
the two graphs are replayed alternately ``--replays`` times (default 10,000): every replay's
outputs must be bitwise identical to the first replay's (compared on the device after every
replay), with no timed-out wait.

Rank 0 writes ``<out>/<name>.json`` (default name ``dist_check_w<N>``): every case with its seed
and worst errors, the worst errors per dtype, failures per rank, skipped cases (an instance the
build lacks), the graph check and the environment (GPUs, driver, torch, CUDA, NCCL, topology,
commit from $ARFUSE_COMMIT or git). Exit status 0 when everything passed, 1 on any failure, 2 on
bad arguments.

NVLink multicast stays off: importing this module sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 as defaults in os.environ, before
any process group, NCCL communicator or CUDA context exists (arfuse's import creates none);
arfuse itself never creates multicast objects.

Testing seam (hidden option): ``--fake-op reference`` replaces the kernel by the float32 PyTorch
definition of all N ranks (no Communicator, no library needed), so that the harness itself --
seeds, fingerprints, gathers, checks, report -- runs with several processes on a CPU;
``--fake-op corrupt`` does the same but the last rank spoils one element (the run must fail).
"""

from __future__ import annotations

import argparse

from .cases import DEFAULT_MAX_TOKENS, SUITES


DEFAULT_REPLAYS = 10_000
QUICK_REPLAYS = 200


class DistCheckError(Exception):
    """A user-facing error: one line, exit status 2."""

def _device(text: str) -> str:
    from .._tools.ranks import parse_device

    try:
        return parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from .._cli import HelpFormatter

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m arfuse.check",
        description="arfuse's correctness suite with one process per GPU: the real Communicator, "
                    "every case of the one-shot/two-shot suites checked element by element "
                    "against a float64 reference, outputs bitwise identical across ranks, and a "
                    "CUDA graph replayed many times. Writes a JSON report; exit status 1 on any "
                    "failure.",
        formatter_class=HelpFormatter)
    p.add_argument("--out", default="dist-check-out", help="directory for the JSON report")
    p.add_argument("--name", help="report file stem (default: dist_check_w<N>)")
    p.add_argument("--replays", type=int, default=None,
                   help=f"graph replays per algorithm (default: {DEFAULT_REPLAYS}, "
                        f"{QUICK_REPLAYS} with --quick; 0: no graph check)")
    p.add_argument("--quick", action="store_true",
                   help="a subset: one or two shapes per suite (every suite still runs)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="the communicators' capacity, also the largest token count checked")
    p.add_argument("--only", default=None,
                   help="comma list of suites to run (default: all): " + ", ".join(SUITES))
    p.add_argument("--seed", type=int, default=None,
                   help="base seed (default: drawn by rank 0); case seeds derive from it and the "
                        "case name, so --seed S --only SUITE reproduces a case")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="default process group's backend (auto: nccl with CUDA, else gloo)")
    p.add_argument("--device", type=_device, default="auto",
                   help="auto: cuda:LOCAL_RANK when CUDA is available, else the CPU (world "
                        "size 1 only: the CPU implementation); cuda:K puts every rank on GPU K "
                        "(ranks sharing one GPU: a test mode, with --backend gloo; "
                        "docs/multigpu.md)")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="communicator wait timeout: a call that waits longer for a peer gives "
                        "up (NaN outputs, the case fails) instead of hanging")
    p.add_argument("--pg-timeout-s", type=float, default=600.0,
                   help="timeout of the process groups' collectives")
    p.add_argument("--fake-op", choices=("reference", "corrupt"), default=None,
                   help=argparse.SUPPRESS)
    return p


def resolve_args(ns: argparse.Namespace) -> argparse.Namespace:
    """Checks and completes parsed arguments (no torch needed). Raises DistCheckError."""
    if ns.replays is None:
        ns.replays = QUICK_REPLAYS if ns.quick else DEFAULT_REPLAYS
    if ns.replays < 0:
        raise DistCheckError(f"--replays must be >= 0, got {ns.replays}")
    if ns.max_tokens < 1:
        raise DistCheckError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    if ns.timeout_s <= 0:
        raise DistCheckError(f"--timeout-s must be positive, got {ns.timeout_s}")
    if ns.pg_timeout_s <= 0:
        raise DistCheckError(f"--pg-timeout-s must be positive, got {ns.pg_timeout_s}")
    if ns.only is None:
        ns.suites = list(SUITES)
    else:
        names = [s.strip() for s in ns.only.split(",") if s.strip()]
        bad = [s for s in names if s not in SUITES]
        if bad:
            raise DistCheckError(f"--only: unknown suite {', '.join(bad)}; choose from "
                                 f"{', '.join(SUITES)}")
        if not names:
            raise DistCheckError("--only: empty list")
        ns.suites = [s for s in SUITES if s in names]
    if ns.name is not None and (not ns.name or "/" in ns.name):
        raise DistCheckError(f"--name: {ns.name!r} is not a file stem")
    return ns


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        return resolve_args(ns)
    except DistCheckError as e:
        parser.error(str(e))
