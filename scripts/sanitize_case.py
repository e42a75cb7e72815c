"""A small world-4 case for compute-sanitizer (memcheck, racecheck): both algorithms, permuted
input with absent experts, T = 37, a specialised-size and a generic-size hidden; then the dynamic
FP8 outputs (per token with an upper bound, per group of 128 column-major) at a generic size.

    compute-sanitizer --tool memcheck python3 scripts/sanitize_case.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

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


if __name__ == "__main__":
    main()
