"""Run by test_plugin.py in a fresh process: loads the general plugins through vLLM's own loader
(vllm.plugins.load_general_plugins) and prints, as JSON, what that imported and logged.

Usage: python entry_probe.py

The caller runs it twice: with the arfuse plugin allowed and with VLLM_PLUGINS naming none, so
that what vLLM's loader imports by itself can be told apart from what the plugin imports.
"""

from __future__ import annotations

import json
import logging
import sys

import vllm.plugins  # vLLM's loader, and whatever vLLM imports with it


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name} {record.levelname}: {record.getMessage()}")


def main() -> None:
    records = Records()
    for name in ("", "vllm", "vllm.arfuse"):
        logging.getLogger(name).addHandler(records)
    logging.getLogger("vllm.arfuse").setLevel(logging.DEBUG)
    before = set(sys.modules)
    vllm.plugins.load_general_plugins()
    new = sorted(set(sys.modules) - before)
    torch = sys.modules.get("torch")
    loaded = [] if torch is None else sorted(getattr(torch.ops, "loaded_libraries", ()))
    print(json.dumps({
        "new_modules": new,
        "log": [ln for ln in records.lines if "arfuse" in ln],
        "loaded_libraries": [p for p in loaded if "arfuse" in p],
    }))


if __name__ == "__main__":
    main()
