"""Shared test setup: the compiled library under test and the GPU marker.

make test points ARFUSE_LIBRARY at the CI-matrix build (build/ci/lib) and ARFUSE_MANIFEST at its
manifest. Tests marked `gpu` are skipped, with the reason, where there is no CUDA device.
"""

import json
import os
import sys

# Before CUDA initialises: one hardware queue per emulated rank's stream (see arfuse.testing).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ARFUSE_TEST_INSTALLED=1: test the installed arfuse (a wheel), not this checkout's package
# (scripts/wheel_check.sh); run from outside the checkout so that it is not on sys.path either.
INSTALLED = os.environ.get("ARFUSE_TEST_INSTALLED") == "1"
if not INSTALLED and ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if INSTALLED:
    import arfuse as _installed

    if os.path.dirname(os.path.dirname(os.path.abspath(_installed.__file__))) == ROOT:
        raise RuntimeError("ARFUSE_TEST_INSTALLED=1 but arfuse is imported from the checkout "
                           f"{ROOT}: run pytest from another directory")


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the GPU machine: make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def lib():
    import arfuse

    if not arfuse.is_built():
        pytest.fail(f"the compiled library is missing at {arfuse.library_path()}: run make")
    return arfuse


@pytest.fixture(scope="session")
def manifest():
    from arfuse import _lib

    with open(_lib.manifest_path()) as f:
        return json.load(f)
