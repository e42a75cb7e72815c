"""The benchmark, ``python -m arfuse.bench`` (``torchrun ... -m arfuse.bench`` for one GPU per
rank). A tool beside the library, not part of its API:

    cli.py          arguments, the model table, main (no torch at import: --help runs anywhere)
    outputs.py      the files a run writes: CSV, markdown, JSON, plot, the tuning row
    run.py          the run: every implementation at every token count (imported when a run
                    starts, with torch and arfuse), built on
      group.py      the ranks this process drives, their communicators and their health
      inputs.py     the input sets and the float32 reference the correctness guard checks against
      impls.py      the implementations timed, one class each, and build_impl
      flashinfer.py FlashInfer's fused all-reduce as the benchmark calls it (torchrun only)
      timing.py     copy bandwidth, the one-call correctness guard, CUDA-graph replay timing
    ladder.py       issue 16's latency ladder (python -m arfuse.bench.ladder)
    byte_counts.py  bytes moved per call and rank, per implementation (pure Python)
    report.py       statistics, CSV, markdown table, plot
    quant.py        the separate Triton FP8 quantization kernel (--quant)

The rank / process-group setup and the provenance of a run (commit, card, versions) are shared
with ``arfuse.check`` (``arfuse._tools``).
"""
