"""What the command-line tools (``arfuse.bench``, ``arfuse.check``) share and the library does not
use: this process's place in a torchrun group (``ranks``) and the provenance of a run
(``provenance``)."""
