"""The MoE models arfuse is tuned for, from variants/models.yaml (shipped in the wheel)."""

from __future__ import annotations

import functools
import os

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _models_file() -> str:
    for path in (
        os.path.join(_PKG_DIR, "..", "variants", "models.yaml"),  # a source checkout
        os.path.join(_PKG_DIR, "_lib", "models.yaml"),  # an installed wheel
    ):
        if os.path.exists(path):
            return os.path.abspath(path)
    raise FileNotFoundError("arfuse: models.yaml not found (variants/ or the package's _lib/)")


@functools.lru_cache(maxsize=1)
def models() -> dict:
    """name -> {"hidden", "top_k", "experts", ...} for every model in models.yaml."""
    import yaml

    with open(_models_file()) as f:
        doc = yaml.safe_load(f)
    return {m["name"]: dict(m) for m in doc["models"]}
