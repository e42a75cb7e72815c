"""arfuse: fused MoE finalize + shared-expert add + all-reduce + residual add + RMSNorm.

    comm = arfuse.Communicator(group, max_tokens=8192, hidden=7168, dtype=torch.bfloat16)
    norm_out, residual_out = arfuse.moe_finalize_allreduce_rmsnorm(
        comm, expert_out, residual, gamma, 1e-6,
        permuted_idx=idx, expert_weights=w, shared_out=shared)
    # FP8 output with dynamic scales (quant="fp8_token" or "fp8_group128"):
    q, residual_out, scales = arfuse.moe_finalize_allreduce_rmsnorm(
        comm, expert_out, residual, gamma, 1e-6, quant="fp8_group128", scale_layout="col")

    # One GPU (tensor-parallel size 1): no all-reduce, one kernel, nothing allocated.
    comm = arfuse.local_communicator(max_tokens=8192, hidden=2048, dtype=torch.bfloat16)

See README.md and docs/ for the operation's exact definition, the algorithms and their limits.
"""

from ._lib import is_built, library_path
from .comm import Communicator, local_communicator
from .models import models
from .ops import (
    QUANT_KINDS,
    instance_for,
    moe_finalize,
    moe_finalize_allreduce_rmsnorm,
    oneshot_threshold,
    supported,
    supported_variants,
)

__all__ = [
    "QUANT_KINDS",
    "Communicator",
    "instance_for",
    "is_built",
    "library_path",
    "local_communicator",
    "models",
    "moe_finalize",
    "moe_finalize_allreduce_rmsnorm",
    "oneshot_threshold",
    "supported",
    "supported_variants",
]

__version__ = "0.1.0"

is_built()  # load the ops now if the library is there; errors surface on first use
