"""Shared test setup: the package and library under test and the GPU marker.

make test installs the wheel it built from the CI-matrix library into the lane's environment and
runs the suite from a folder outside the checkout with ARFUSE_TEST_INSTALLED=1: `import arfuse`
must then resolve to site-packages and the library to the wheel's own (checked here, before any
test). From the checkout's root, the checkout's package is tested, with the library at
ARFUSE_LIBRARY (and its manifest at ARFUSE_MANIFEST) or in arfuse/_lib. Tests marked `gpu` are
skipped, with the reason, where there is no CUDA device.
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
    import sysconfig

    import arfuse as _installed

    # Where the wheel went: this environment's site-packages (make test), or the --target folder
    # scripts/wheel_check.sh names.
    _site = os.path.realpath(os.environ.get("ARFUSE_TEST_SITE") or sysconfig.get_paths()["purelib"])
    _where = os.path.realpath(_installed.__file__)
    if not _where.startswith(_site + os.sep):
        raise RuntimeError(f"ARFUSE_TEST_INSTALLED=1 but arfuse is imported from {_where}, not "
                           f"from the installed wheel under {_site}: run pytest from a folder "
                           "outside the checkout, with the wheel installed")
    if os.environ.get("ARFUSE_LIBRARY") or os.environ.get("ARFUSE_MANIFEST"):
        raise RuntimeError("ARFUSE_TEST_INSTALLED=1 tests the wheel's own library: unset "
                           "ARFUSE_LIBRARY and ARFUSE_MANIFEST")


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
