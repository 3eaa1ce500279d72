#!/usr/bin/env python3
"""Puts the Nations and UMLS knowledge graphs under tools/kge/data/: the train/valid/test
triples the pykeen wheel (1.11.1, from PyPI) ships, read out of the wheel without
installing pykeen or its dependencies. Run by `make kge-data`."""

from __future__ import annotations

import glob
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
WHEEL_DIR = HERE / "wheel"
DATA = HERE / "data"


def main() -> int:
    if not glob.glob(str(WHEEL_DIR / "pykeen-1.11.1-*.whl")):
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
             "pykeen==1.11.1", "-d", str(WHEEL_DIR)],
            check=True,
        )  # fmt: skip
    wheel = zipfile.ZipFile(glob.glob(str(WHEEL_DIR / "pykeen-1.11.1-*.whl"))[0])
    for name in ("nations", "umls"):
        (DATA / name).mkdir(parents=True, exist_ok=True)
        for split in ("train", "valid", "test"):
            (DATA / name / f"{split}.txt").write_bytes(wheel.read(f"pykeen/datasets/{name}/{split}.txt"))
    (DATA / ".fetched").touch()
    print(f"knowledge graphs in {DATA}: nations, umls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
