"""The multi-GPU correctness check, ``torchrun --nproc-per-node N -m arfuse.check`` (``dist.py``;
``python -m arfuse.check --quick`` runs world size 1). A tool beside the library, not part of its
API; its rank setup and provenance are shared with ``arfuse.bench`` (``arfuse._tools``)."""
