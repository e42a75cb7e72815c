"""Resolves a vLLM release's whole dependency set with pip and writes it as a lock file (the
requirements-vllm*.txt files; scripts/install-vllm.sh installs them with --no-deps).

Run it with the Python of a throwaway virtual environment of the lock's interpreter (CPython 3.11 on
Linux x86_64 for the committed locks): pip resolves for the interpreter that runs it.

    python3.11 -m venv /tmp/lock && /tmp/lock/bin/python scripts/vllm_lock.py 0.34.0 \
        requirements-vllm-0.34.txt --exclude flashinfer-python --add pytest==9.2.0

What it does: downloads the release's wheel (--no-deps), reads its Requires-Dist (extras left
out), drops the --exclude packages (ones pip cannot resolve, e.g. a pin that is not on PyPI; only
packages scripts/install-vllm.sh skips anyway), lets `pip install --dry-run --report` resolve the
rest plus --add, and writes `name==version` lines sorted, vllm last. The comment block at the top
of an existing OUT is kept (the human-written explanation).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [l.split(": ", 1)[1] for l in lines if l.startswith("Requires-Dist: ")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("version")
    ap.add_argument("out", type=Path)
    ap.add_argument("--exclude", action="append", default=[])
    ap.add_argument("--add", action="append", default=[])
    args = ap.parse_args()
    excluded = {e.lower().replace("_", "-") for e in args.exclude}
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        subprocess.run(pip + ["download", "-q", "--no-deps", "--no-cache-dir", "-d", tmp,
                              f"vllm=={args.version}"], check=True)
        wheel = next(tmp_path.glob("vllm-*.whl"))
        reqs = [r for r in requires_dist(wheel)
                if "extra ==" not in r and _name(r) not in excluded]
        wheel.unlink()
        (tmp_path / "req.txt").write_text("\n".join(reqs + args.add) + "\n")
        report = tmp_path / "report.json"
        subprocess.run(pip + ["install", "-q", "--no-cache-dir", "--dry-run", "--ignore-installed",
                              "--report", str(report), "-r", str(tmp_path / "req.txt")], check=True)
        installed = json.loads(report.read_text())["install"]
    pins = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installed)
    header = []
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line)
    args.out.write_text("\n".join(header + pins + [f"vllm=={args.version}"]) + "\n")
    print(f"{args.out}: {len(pins) + 1} pins", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
