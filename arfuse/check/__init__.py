"""The multi-GPU correctness check, ``torchrun --nproc-per-node N -m arfuse.check`` (``python -m
arfuse.check --quick`` runs world size 1). A tool beside the library, not part of its API; its rank
setup and provenance are shared with ``arfuse.bench`` (``arfuse._tools``):

    cli.py        the command line: usage, arguments and their rules
    run.py        the whole check on this rank, its report and exit status (``main``)
    cases.py      the cases, by suite, and their seeds
    runner.py     one rank's process groups, device and communicators
    run_case.py   one case on every rank, and the CUDA-graph replay check
    report.py     counts, worst errors, the JSON report and its summary lines
    multicast.py  NVLink multicast off, set as defaults when this package is imported

Importing the package sets the multicast-off defaults (``multicast``) before any process group,
NCCL communicator or CUDA context exists.
"""

from . import multicast as _multicast  # noqa: F401  (its import sets the defaults)
