"""Local `embank serve` shards for the DLRM example (`--local-shards N`).

Each shard is a detached `python -m embank serve` process on a free loopback port, its
store in ``WORK/shards/<i>/store`` and its log in ``WORK/shards/<i>/serve.log``;
``WORK/shards/shards.json`` names their addresses and pids. A trainer restarted by
``torchrun`` finds them alive and reuses them (they hold the rows since the last
checkpoint, which the resume restores); a fresh run stops old ones and starts anew.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie (exited, not yet reaped by its parent) is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


def running(work: Path) -> list[str] | None:
    """Addresses of the shards started for ``work`` if they all still run."""
    meta = work / "shards" / "shards.json"
    if not meta.exists():
        return None
    m = json.loads(meta.read_text())
    if all(_alive(p) for p in m["pids"]):
        return list(m["addrs"])
    return None


def stop(work: Path, timeout: float = 60.0) -> None:
    """Stops the shards of ``work`` (SIGTERM: each flushes its store and exits)."""
    meta = work / "shards" / "shards.json"
    if not meta.exists():
        return
    pids = json.loads(meta.read_text())["pids"]
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    meta.unlink()


def start(work: Path, n: int, fresh: bool) -> list[str]:
    """Starts ``n`` shards (or, unless ``fresh``, reuses live ones); returns addresses."""
    if not fresh and (addrs := running(work)) is not None and len(addrs) == n:
        return addrs
    stop(work)
    root = work / "shards"
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    pids, logs = [], []
    for i in range(n):
        d = root / str(i)
        d.mkdir(exist_ok=True)
        log = d / "serve.log"
        with open(log, "w") as out:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "embank",
                    "serve",
                    "--store",
                    str(d / "store"),
                    "--listen",
                    "127.0.0.1:0",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # outlives a trainer that is killed and restarted
                env={**os.environ, "EMBANK_LOG": os.environ.get("EMBANK_LOG", "warn")},
            )
        pids.append(p.pid)
        logs.append(log)
    addrs = []
    deadline = time.monotonic() + 60
    for pid, log in zip(pids, logs):
        while True:
            text = log.read_text()
            if "listening on " in text:
                addrs.append(text.split("listening on ")[1].split()[0].rstrip(","))
                break
            if not _alive(pid) or time.monotonic() > deadline:
                raise RuntimeError(f"embank serve did not start: {log}:\n{text}")
            time.sleep(0.05)
    tmp = root / "shards.json.tmp"
    tmp.write_text(json.dumps({"addrs": addrs, "pids": pids}))
    os.replace(tmp, root / "shards.json")
    return addrs


def shared(work: Path, n: int, fresh: bool, rank: int, barrier: Callable[[], None]) -> list[str]:
    """The addresses of ``n`` shards every rank shares: rank 0 starts them (or, unless
    ``fresh``, finds them running) while the others wait at ``barrier``."""
    if rank == 0:
        start(work, n, fresh)
    barrier()
    addrs = running(work)
    if addrs is None:
        raise RuntimeError(f"the local shards under {work} are not running")
    return addrs
