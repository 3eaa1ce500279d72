"""A throwaway Redis Cluster on loopback for tests and benchmarks: three masters from
Debian's `redis-server`, slots split by `redis-cli --cluster create`, no persistence.

    procs, addrs = start(Path("/tmp/x"))   # addrs: ["127.0.0.1:PORT", ...]
    ...
    stop(procs)
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = int(s.getsockname()[1])
        if p < 55000:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 10000))
                    return p
                except OSError:
                    pass


def cli(port: int, *args: str) -> str:
    r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True)
    return r.stdout + r.stderr


def start(
    root: Path, masters: int = 3, timeout: float = 30.0
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """Starts the nodes under `root`, creates the cluster, waits until its state is ok."""
    procs: list[subprocess.Popen[bytes]] = []
    ports = []
    try:
        for i in range(masters):
            port, d = free_port(), root / f"redis{i}"
            d.mkdir(parents=True)
            args = ["--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--save", ""]
            args += ["--cluster-config-file", "nodes.conf", "--appendonly", "no", "--dir", str(d)]
            procs.append(subprocess.Popen(["redis-server", *args], stdout=subprocess.DEVNULL))
            ports.append(port)
        deadline = time.monotonic() + timeout
        for p in ports:
            while "PONG" not in cli(p, "ping"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {p} did not start")
                time.sleep(0.05)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        r = subprocess.run(
            ["redis-cli", "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{r.stdout}{r.stderr}")
        while not all("cluster_state:ok" in cli(p, "cluster", "info") for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        return procs, addrs
    except BaseException:
        stop(procs)
        raise


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
