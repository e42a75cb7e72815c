#!/usr/bin/env python3
"""Checks what arfuse's vLLM integration uses (the table in arfuse/vllm/contract/) against vLLM
releases, without installing them.

    scripts/vllm_contract.py                 every supported release, from PyPI
    scripts/vllm_contract.py 0.33.0 0.34.0   these releases
    scripts/vllm_contract.py --installed     the vLLM installed in this interpreter (import and
                                             inspect; needs torch and vLLM, no GPU)

Static mode: for each release, `pip download vllm==X --no-deps --no-cache-dir` into a temporary
folder, read the needed .py files straight out of the wheel (zipfile, here) and check every item
with the AST check (arfuse/vllm/contract/source.py), then delete the wheel. Prints a table (item x
release -> ok / changed / missing), the details of everything not ok, the time and the peak disk
(the wheel) per release. Exit status 1 when an item the integration needs (hook, pass, slot; see the table's
docstring) is missing on a supported release, 0 otherwise, 2 on a download failure.

Standard library only (pip as a subprocess); the table is loaded by path, so neither torch nor
vLLM is needed. `--source-dir DIR` reads unpacked trees DIR/<version>/vllm/... instead of
downloading (for working on the table).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTRACT = REPO / "arfuse" / "vllm" / "contract"


def _tables():
    """The contract package (its data, Result, and the AST check `source`), loaded by path as a
    package of its own: neither arfuse's import (torch) nor vLLM is needed."""
    name = "arfuse_vllm_contract"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, CONTRACT / "__init__.py", submodule_search_locations=[str(CONTRACT)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    contract = sys.modules[name]
    return contract, importlib.import_module(f"{name}.source")


def zip_source(source_module, wheel: str):
    """A released wheel as a Source of the AST check: its `vllm/...` files read from the zip."""

    class ZipSource(source_module.Source):
        def __init__(self) -> None:
            self.zip = zipfile.ZipFile(wheel)
            self.names = set(self.zip.namelist())

        def read(self, path: str) -> str | None:
            if path not in self.names:
                return None
            return self.zip.read(path).decode("utf-8", errors="replace")

        def binaries(self) -> list[str]:
            return sorted(n for n in self.names if n.startswith("vllm/_C") and n.endswith(".so"))

        def read_bytes(self, path: str) -> bytes:
            return self.zip.read(path)

    return ZipSource()


SYMBOL = {"ok": "ok", "changed": "CHANGED", "missing": "MISSING"}


def print_table(contract, versions: list[str], results: dict[str, list]) -> None:
    keys = [i.key for i in contract.ITEMS]
    width = max(len(k) for k in keys) + 8
    print(f"{'item (need)':<{width}}" + "".join(f"{v:>9}" for v in versions))
    for n, item in enumerate(contract.ITEMS):
        row = f"{item.key + ' (' + item.need + ')':<{width}}"
        for v in versions:
            row += f"{SYMBOL[results[v][n].status]:>9}"
        print(row)


def print_details(versions: list[str], results: dict[str, list]) -> None:
    """Each non-ok finding once, with the releases it holds for."""
    seen: dict[tuple[str, str, str], list[str]] = {}
    for v in versions:
        for r in results[v]:
            if r.status != "ok":
                seen.setdefault((r.item.key, r.status, r.detail), []).append(v)
    if seen:
        print("\nnot ok:")
    for (key, status, detail), vs in seen.items():
        print(f"  {key}: {status} on {', '.join(vs)}: {detail}")


def _pip_download(version: str, dest: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-cache-dir",
           "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64", "-d", dest,
           f"vllm=={version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = list(Path(dest).glob("vllm-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for vllm=={version} in {dest}, found {wheels}")
    return wheels[0]


def _dir_size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def check_release(contract, source_check, version: str, source_dir: str | None) -> tuple[list, dict]:
    start = time.monotonic()
    stats: dict[str, float] = {}
    if source_dir:
        source = source_check.DirSource(os.path.join(source_dir, version))
        index = source_check.Index(source)
        results = [source_check.check(index, i) for i in contract.ITEMS]
        stats["seconds"] = time.monotonic() - start
        return results, stats
    tmp = tempfile.mkdtemp(prefix=f"vllm-{version}-")
    try:
        wheel = _pip_download(version, tmp)
        stats["download_s"] = time.monotonic() - start
        stats["peak_mb"] = _dir_size(tmp) / 2**20
        index = source_check.Index(zip_source(source_check, str(wheel)))
        results = [source_check.check(index, i) for i in contract.ITEMS]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stats["seconds"] = time.monotonic() - start
    return results, stats


def run_static(versions: list[str], source_dir: str | None) -> int:
    contract, source_check = _tables()
    results: dict[str, list] = {}
    for v in versions:
        try:
            results[v], stats = check_release(contract, source_check, v, source_dir)
        except (subprocess.CalledProcessError, RuntimeError) as e:
            print(f"vllm {v}: download failed: {e}", file=sys.stderr)
            return 2
        extra = ""
        if "peak_mb" in stats:
            extra = f", download {stats['download_s']:.1f} s, peak disk {stats['peak_mb']:.0f} MB"
        print(f"vllm {v}: checked in {stats['seconds']:.1f} s{extra}", file=sys.stderr)
    print_table(contract, versions, results)
    print_details(versions, results)
    failed = False
    for v in versions:
        problems = contract.summarize(results[v])
        if problems and v in contract.SUPPORTED:
            failed = True
            print(f"\nvllm {v}: the integration needs what is missing or changed:")
            for p in problems:
                print(f"  {p}")
    print("\nresult:", "FAIL" if failed else "every supported release has what the integration needs")
    return 1 if failed else 0


def run_installed() -> int:
    sys.path.insert(0, str(REPO))
    from arfuse.vllm import contract  # noqa: PLC0415
    from arfuse.vllm.contract.installed import check_installed  # noqa: PLC0415
    import vllm  # noqa: PLC0415

    results = check_installed()
    version = vllm.__version__
    print_table(contract, [version], {version: results})
    print_details([version], {version: results})
    problems = contract.summarize(results)
    for p in problems:
        print(f"  needed: {p}")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("versions", nargs="*")
    ap.add_argument("--installed", action="store_true")
    ap.add_argument("--source-dir")
    args = ap.parse_args()
    if args.installed:
        return run_installed()
    contract, _ = _tables()
    return run_static(args.versions or list(contract.SUPPORTED), args.source_dir)


if __name__ == "__main__":
    sys.exit(main())
