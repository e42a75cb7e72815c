"""NVLink multicast off for ``arfuse.check``: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 set as defaults in os.environ when the package is imported, before any
process group, NCCL communicator or CUDA context exists (arfuse's import creates none; arfuse
itself never creates multicast objects)."""

from __future__ import annotations

import os


# NVLink multicast off (see the docstring). Defaults only: an explicit setting is kept, and
# recorded in the report, with a warning when it turns multicast on.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def multicast_off(environ=None) -> dict:
    """Sets the multicast-off variables as defaults in `environ` (os.environ); returns the ones
    whose value differs from the off value (explicit settings left as they are)."""
    environ = os.environ if environ is None else environ
    for key, value in MULTICAST_OFF.items():
        environ.setdefault(key, value)
    return {k: environ[k] for k, v in MULTICAST_OFF.items() if environ[k] != v}


multicast_off()
