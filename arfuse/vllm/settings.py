"""Environment settings of the arfuse vLLM integration, read in one place.

Nothing here imports vLLM or the compiled arfuse library, so the plugin entry point can decide
whether to do anything at all without paying for either.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from .._vocab import ALGORITHMS  # the `algorithm` argument of torch.ops.arfuse.fused

ENABLE_ENV = "ARFUSE_VLLM"
# ARFUSE_VLLM=strict: on, and a start-up failure stops vLLM instead of leaving it unfused.
STRICT = "strict"
MAX_TOKENS_ENV = "ARFUSE_VLLM_MAX_TOKENS"
ONESHOT_MAX_TOKENS_ENV = "ARFUSE_VLLM_ONESHOT_MAX_TOKENS"
ALGORITHM_ENV = "ARFUSE_VLLM_ALGORITHM"
TIMEOUT_ENV = "ARFUSE_VLLM_TIMEOUT_S"
# Whether the fusion pass folds vLLM's static per-tensor FP8 quant of the norm output into the
# fused call (where arfuse has fp8_static kernels for the model).
FP8_ENV = "ARFUSE_VLLM_FP8"
# Whether eligible MoE layers hand their unfinalized expert rows to the graph, so that the
# finalize is fused too (arfuse.vllm.moe_rows).
MOE_ROWS_ENV = "ARFUSE_VLLM_MOE_ROWS"
# Whether the fused kernels launch as programmatic dependents of the kernel before them
# (Communicator.pdl): off by default until measured in an engine.
PDL_ENV = "ARFUSE_VLLM_PDL"
# How long a rank's kernel waits for its peers before giving up (the communicator then reports
# itself broken). Generous by default: in a deployment the ranks reach their first fused call at
# different times (one rank may still be compiling or capturing CUDA graphs), and a wait that
# gives up too early breaks the communicator; arfuse's own default (10 s) suits tests.
DEFAULT_TIMEOUT_S = 600


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """What the user asked for through the environment."""

    enabled: bool
    # Cap on the communicator's capacity in tokens (None: vLLM's max_num_batched_tokens).
    max_tokens: int | None
    # The communicator's one-shot capacity (None: arfuse's default).
    oneshot_max_tokens: int | None
    algorithm: str
    timeout_s: int = DEFAULT_TIMEOUT_S
    fp8: bool = True
    moe_rows: bool = True
    pdl: bool = False

    @property
    def algorithm_code(self) -> int:
        return ALGORITHMS[self.algorithm]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: want 1 or 0" + (" (or strict)" if name == ENABLE_ENV else ""))


def _positive_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: want a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r}: want a positive integer")
    return value


def from_env() -> Settings:
    """Reads the ARFUSE_VLLM* variables; raises ValueError naming a malformed one."""
    algorithm = os.environ.get(ALGORITHM_ENV, "auto").strip().lower() or "auto"
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{ALGORITHM_ENV}={algorithm!r}: want one of {sorted(ALGORITHMS)}")
    return Settings(
        enabled=strict_requested() or _flag(ENABLE_ENV),
        max_tokens=_positive_int(MAX_TOKENS_ENV),
        oneshot_max_tokens=_positive_int(ONESHOT_MAX_TOKENS_ENV),
        algorithm=algorithm,
        timeout_s=_positive_int(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S,
        fp8=_flag(FP8_ENV, default=True),
        moe_rows=_flag(MOE_ROWS_ENV, default=True),
        pdl=_flag(PDL_ENV),
    )


def strict_requested() -> bool:
    """Whether ARFUSE_VLLM=strict: on, and a start-up failure raises (arfuse.vllm.guard.disable)
    instead of leaving vLLM unfused. Read without validating the other variables."""
    return os.environ.get(ENABLE_ENV, "").strip().lower() == STRICT


def source_hash() -> str:
    """Hash of the integration's source files that decide what the compiled graph holds (for
    cache keys). Reads files only, imports nothing."""
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("fusion.py", "patterns.py", "fp8_fold.py", "moe_rows.py", "settings.py"):
        digest.update((here / name).read_bytes())
    return digest.hexdigest()
