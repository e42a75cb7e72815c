"""The benchmark, ``python -m arfuse.bench`` (``torchrun ... -m arfuse.bench`` for one GPU per
rank). A tool beside the library, not part of its API:

    cli.py          arguments, the model table, output files (no torch at import: --help runs
                    anywhere)
    gpu.py          the GPU side: inputs, the implementations timed, the correctness guard,
                    CUDA-graph timing (imported when a run starts)
    byte_counts.py  bytes moved per call and rank, per implementation (pure Python)
    report.py       statistics, CSV, markdown table, plot
    quant.py        the separate Triton FP8 quantization kernel (--quant)

The rank / process-group setup and the provenance of a run (commit, card, versions) are shared
with ``arfuse.check`` (``arfuse._tools``).
"""
