"""A small world-4 case for compute-sanitizer (memcheck, racecheck): both algorithms, permuted
input with absent experts, T = 37, a specialised-size and a generic-size hidden; then the dynamic
FP8 outputs (per token with an upper bound, per group of 128 column-major) at a generic size; then
world size 1 (the local algorithm: arfuse.local_communicator) at a clustered specialised size,
a generic one and with the dynamic FP8 outputs; a token split's twin and its sibling; and calls
launched as programmatic dependents (Communicator.pdl).

    compute-sanitizer --tool memcheck python3 lab/scripts/sanitize_case.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from fused_cases import Case, check_case, check_dynamic_case, run_case  # noqa: E402

from arfuse.testing import LocalGroup  # noqa: E402


def main() -> None:
    for hidden, dtype in ((4096, torch.float16), (2880, torch.bfloat16)):
        with LocalGroup(4, max_tokens=64, hidden=hidden, dtype=dtype, timeout_s=120.0) as group:
            for algo in ("oneshot", "twoshot"):
                for rep in range(2):
                    case = Case(4, hidden, dtype, 37, "permuted", 8, "f32", True, 1.0,
                                absent=0.3, algorithm=algo)
                    outs, inputs = run_case(group, case, 1234 + rep)
                    check_case(case, outs, inputs)
            assert group.status() == [0, 0, 0, 0]
            print(f"ok hidden={hidden} {dtype}")
    with LocalGroup(4, max_tokens=64, hidden=1152, dtype=torch.bfloat16, timeout_s=120.0) as group:
        for algo in ("oneshot", "twoshot"):
            for quant, extra in (("fp8_token", dict(scale_ub=4.0)),
                                 ("fp8_group128", dict(scale_col=True))):
                case = Case(4, 1152, torch.bfloat16, 37, "permuted", 8, "f32", True, 1.0,
                            absent=0.3, algorithm=algo, quant=quant, **extra)
                outs, inputs = run_case(group, case, 4321)
                check_dynamic_case(case, outs, inputs)
        assert group.status() == [0, 0, 0, 0]
        print("ok hidden=1152 bf16 fp8_token, fp8_group128")
    import arfuse

    # A token split (variants/ci.yaml): bf16 two-shot at 4096, N = 2; T = 37 runs the twin built
    # without the blocks-per-SM bound, T = 300 the bounded instance.
    if arfuse.instance_for("bf16", 4096, 2, "twoshot", num_tokens=37) != \
            arfuse.instance_for("bf16", 4096, 2, "twoshot", num_tokens=300):
        with LocalGroup(2, max_tokens=300, hidden=4096, dtype=torch.bfloat16,
                        timeout_s=120.0) as group:
            for tokens in (37, 300):
                case = Case(2, 4096, torch.bfloat16, tokens, "permuted", 8, "f32", True, 2.5,
                            absent=0.3, algorithm="twoshot")
                outs, inputs = run_case(group, case, 555)
                check_case(case, outs, inputs)
            assert group.status() == [0, 0]
        print("ok token split hidden=4096 bf16 N=2 (twin and sibling)")

    class One:  # run_case's group interface over a world-size-1 communicator
        def __init__(self, hidden, dtype):
            self.comm = arfuse.local_communicator(max_tokens=64, hidden=hidden, dtype=dtype)
            self.device, self.world_size = self.comm.device, 1

        def run(self, fn):
            return [fn(0, self.comm)]

    for hidden, dtype, extra in ((7168, torch.bfloat16, {}), (2880, torch.float16, {}),
                                 (7168, torch.bfloat16, dict(quant="fp8_token", scale_ub=4.0)),
                                 (1152, torch.bfloat16, dict(quant="fp8_group128", scale_col=True))):
        one = One(hidden, dtype)
        for layout in ("permuted", "dense"):
            case = Case(1, hidden, dtype, 37, layout, 8, "f32", True, 2.5,
                        absent=0.3 if layout == "permuted" else 0.0, **extra)
            outs, inputs = run_case(one, case, 99)
            (check_dynamic_case if case.quant else check_case)(case, outs, inputs)
        one.comm.close()
        print(f"ok local hidden={hidden} {dtype} {extra.get('quant', 'norm')}")

    # Programmatic dependent launch (Communicator.pdl): the same calls launched as dependents of
    # the kernel before them, world size 4 (both algorithms) and world size 1.
    with LocalGroup(4, max_tokens=64, hidden=2880, dtype=torch.bfloat16, timeout_s=120.0,
                    pdl=True) as group:
        for algo in ("oneshot", "twoshot"):
            case = Case(4, 2880, torch.bfloat16, 37, "permuted", 8, "f32", True, 1.0,
                        absent=0.3, algorithm=algo)
            outs, inputs = run_case(group, case, 777)
            check_case(case, outs, inputs)
        assert group.status() == [0, 0, 0, 0]
    one = One(7168, torch.bfloat16)
    one.comm.pdl = True
    case = Case(1, 7168, torch.bfloat16, 37, "permuted", 8, "f32", True, 2.5, absent=0.3)
    outs, inputs = run_case(one, case, 778)
    check_case(case, outs, inputs)
    one.comm.close()
    print("ok pdl hidden=2880 N=4 (both algorithms), hidden=7168 local")


if __name__ == "__main__":
    main()
