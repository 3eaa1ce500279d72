"""The newcomer's path, as `.ci/run` proves it (and anyone can, by hand):

    python3 tools/newcomer.py dist/embank-*.whl

installs the wheel into a fresh venv, with no Rust, no compiler and no cargo on PATH,
checks that its extension and its `embank` program link no library beyond the C runtime
(and no glibc newer than the wheel's tag), times the way from `pip install` to the first
pulled rows, then runs an embedded and a served round trip
through the wheel's own `embank` command: `embank serve` as a primary, and as a replica
fed through Redis Streams and through Kafka where a broker can be started here
(`redis-server` on PATH; Kafka's jars from `make kafka-jars`), and a smoke run of every
subcommand that starts embank again (`bench-recovery`, `soak`) or brokers
(`bench-stream`). Prints what it did and how long each part took; exits non-zero on the
first failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What a manylinux wheel may link (the C runtime); anything else is a system library
# the user would have to install.
ALLOWED_NEEDED = re.compile(r"^(libc|libm|libdl|libpthread|librt|libgcc_s|ld-linux[-\w]*)\.so(\.\d+)*$")


def say(msg: str) -> None:
    print(f"newcomer: {msg}", flush=True)


def clean_env(venv: Path) -> dict[str, str]:
    """PATH with the venv and the system's directories only: no ~/.cargo/bin, no pyenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CARGO_HOME")}
    dirs = [str(venv / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
    env["PATH"] = ":".join(d for d in dirs if Path(d).is_dir())
    env["VIRTUAL_ENV"] = str(venv)
    return env


def check_needed(wheel: Path, work: Path) -> None:
    """The extension and the `embank` program in the wheel link only the C runtime."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        sos = [n for n in names if n.endswith(".so")]
        if len(sos) != 1:
            raise SystemExit(f"newcomer: expected one extension in {wheel.name}, found {sos}")
        if "embank/bin/embank" not in names:
            raise SystemExit(f"newcomer: {wheel.name} has no embank/bin/embank (the embank command)")
        binaries = [work / z.extract(n, work) for n in (sos[0], "embank/bin/embank")]
    if shutil.which("readelf") is None:
        say("readelf missing: the NEEDED lists not checked")
        return
    for binary in binaries:
        readelf = ["readelf", "-d", str(binary)]
        out = subprocess.run(readelf, capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
        extra = [n for n in needed if not ALLOWED_NEEDED.match(n)]
        if extra:
            raise SystemExit(f"newcomer: {binary.name} links system libraries a user must install: {extra}")
        # maturin checks the extension's symbol versions against the wheel's tag; the
        # program it only packs, so it is checked here.
        tag = re.search(r"manylinux_(\d+)_(\d+)", wheel.name)
        versions = subprocess.run(["readelf", "-V", str(binary)], capture_output=True, text=True).stdout
        glibc = max((tuple(map(int, v)) for v in re.findall(r"GLIBC_(\d+)\.(\d+)", versions)), default=(0, 0))
        if tag and glibc > (int(tag[1]), int(tag[2])):
            raise SystemExit(f"newcomer: {binary.name} needs glibc {glibc}, newer than the tag {tag[0]}")
        say(
            f"{binary.name}: {binary.stat().st_size / 2**20:.1f} MB, links only {', '.join(needed)}"
            f" (glibc >= {glibc[0]}.{glibc[1]})"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_serve(
    embank: Path, config: Path, env: dict[str, str], log: Path
) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [str(embank), "serve", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env=env,
    )
    assert p.stdout is not None
    line = p.stdout.readline()
    m = re.search(r"listening on (\S+?),", line)
    if not m:
        p.kill()
        raise SystemExit(f"newcomer: embank serve did not start: {line!r}; see {log}")
    return p, m.group(1)


ROUND_TRIP = r"""
import sys, time, numpy as np, embank
mode, arg = sys.argv[1], sys.argv[2]
keys = np.arange(1, 2001, dtype=np.uint64) * 7919
if mode == "embedded":
    with embank.open(arg) as s:
        t = s.create_table("t", dim=16, capacity=10_000)
        rows = t.pull(keys)
        t.push(keys, rows + 1.0)
        got, found = t.lookup(keys)
        assert found.all() and np.array_equal(got, rows + 1.0)
        s.checkpoint(1)
    with embank.open(arg) as s:
        got, found = s.table("t").lookup(keys)
        assert found.all() and np.array_equal(got, rows + 1.0), "reopened rows differ"
    print("embedded: 2000 rows pulled, pushed, reopened equal")
elif mode == "served":
    with embank.connect([arg], timeout=10) as s:
        t = s.table("t")
        rows = t.pull(keys)
        t.push(keys, rows * 2.0)
        got, found = t.lookup(keys)
        assert found.all() and np.array_equal(got, rows * 2.0)
    print("served: 2000 rows pulled, pushed, read back equal over TCP")
else:  # a publisher to a broker; the replica at sys.argv[4] must serve checkpoint 3
    transport, brokers, replica = mode, arg, sys.argv[3]
    with embank.open(sys.argv[4]) as s:
        t = s.create_table("t", dim=16, capacity=10_000)
        pub = s.publisher(transport, brokers, topic="newcomer")
        for b in (1, 2, 3):
            t.push(keys, np.full((len(keys), 16), float(b), np.float32))
            s.checkpoint(b)
        pub.flush(timeout=60)
        with embank.connect([replica], timeout=10) as r:
            deadline = time.time() + 60
            while True:
                try:
                    got, found = r.table("t").lookup(keys, min_checkpoint=3)
                    if found.all() and (got == 3.0).all():
                        break
                except (embank.errors.ShardUnavailableError, KeyError):
                    pass  # not at checkpoint 3 yet, or the table not there yet
                if time.time() > deadline:
                    raise SystemExit(f"replica over {transport} did not serve checkpoint 3: {r.served()}")
                time.sleep(0.2)
    print(f"replica over {transport}: checkpoint 3 served, rows equal to the trainer's")
"""


def run(cmd: list[str], env: dict[str, str], what: str, timeout: float = 600) -> float:
    t = time.monotonic()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-4000:])
        shown = " ".join(c if len(c) < 200 else c[:40] + "..." for c in cmd)
        raise SystemExit(f"newcomer: {what} failed (exit {r.returncode}): {shown}")
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
    dt = time.monotonic() - t
    say(f"{what}: {dt:.1f} s" + (f" ({lines[-1].strip()[:120]})" if lines else ""))
    return dt


def broker(kind: str, work: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    port = free_port()
    data = work / f"{kind}-data"
    data.mkdir()
    if kind == "redis":
        if shutil.which("redis-server") is None:
            return None, ""
        cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(data)]
        addr = f"redis://127.0.0.1:{port}"
    else:
        if not (ROOT / "tools/kafka/lib").is_dir() or shutil.which("java") is None:
            return None, ""
        while True:  # the controller takes the next port
            port = free_port()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port + 1)) != 0:
                    break
        cmd = ["bash", str(ROOT / "tools/kafka/broker.sh"), str(data), str(port)]
        addr = f"127.0.0.1:{port}"
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 90
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p, addr
        if time.time() > deadline or p.poll() is not None:
            raise SystemExit(f"newcomer: could not start a {kind} broker")
        time.sleep(0.2)


def stop(p: subprocess.Popen[bytes] | subprocess.Popen[str] | None) -> None:
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, 9)
        except (PermissionError, ProcessLookupError):
            p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--skip-subcommands", action="store_true", help="no bench-recovery, soak, bench-stream")
    a = ap.parse_args()
    wheel = a.wheel.resolve()
    say(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MB")
    with tempfile.TemporaryDirectory(prefix="embank-newcomer-") as tmp:
        work = Path(tmp)
        check_needed(wheel, work / "so")
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = clean_env(venv)
        for tool in ("cargo", "rustc"):
            if shutil.which(tool, path=env["PATH"]):
                say(f"note: {tool} is on the system PATH ({shutil.which(tool, path=env['PATH'])})")
        py, embank = venv / "bin/python", venv / "bin/embank"
        t0 = time.monotonic()
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        run([*pip, str(wheel)], env, "pip install")
        run([str(py), "-c", ROUND_TRIP, "embedded", str(work / "embedded")], env, "embedded round trip")
        say(f"from pip install to the first result: {time.monotonic() - t0:.1f} s (goal < 60 s)")
        run([str(embank), "--help"], env, "embank --help")

        procs: list[subprocess.Popen[str] | subprocess.Popen[bytes] | None] = []
        try:
            cfg = work / "primary.toml"
            table = '[[tables]]\nname = "t"\ndim = 16\n'
            cfg.write_text(f'store = "{work / "primary"}"\nlisten = "127.0.0.1:0"\n{table}')
            p, addr = start_serve(embank, cfg, env, work / "primary.log")
            procs.append(p)
            run([str(py), "-c", ROUND_TRIP, "served", addr], env, "served round trip")
            for kind in ("redis", "kafka"):
                b, brokers = broker(kind, work)
                if b is None:
                    say(f"no {kind} broker here: replica over {kind} not checked")
                    continue
                procs.append(b)
                rcfg = work / f"replica-{kind}.toml"
                rcfg.write_text(
                    f'store = "{work / ("replica-" + kind)}"\nlisten = "127.0.0.1:0"\n'
                    f'[updates]\ntransport = "{kind}"\nbrokers = "{brokers}"\ntopic = "newcomer"\n'
                )
                r, raddr = start_serve(embank, rcfg, env, work / f"replica-{kind}.log")
                procs.append(r)
                args = [str(py), "-c", ROUND_TRIP, kind, brokers, raddr, str(work / f"trainer-{kind}")]
                run(args, env, f"replica over {kind}")
                if not a.skip_subcommands:
                    small = f"--transport {kind} --brokers {brokers} --rows 20000 --dim 16"
                    small += " --checkpoint-rows 2000 --checkpoints 3 --seconds 1"
                    small += " --train-batches 200 --checkpoint-every 50 --repeats 1"
                    run(
                        [str(embank), "bench-stream", *small.split()],
                        env,
                        f"embank bench-stream --transport {kind} (smoke)",
                    )
        finally:
            for proc in procs:
                stop(proc)
        if not a.skip_subcommands:
            rec = ["--path", str(work / "rec"), "--rows", "20000", "--repeats", "1", "--writes", "2000"]
            run([str(embank), "bench-recovery", *rec], env, "embank bench-recovery (smoke)")
            soak = ["--duration", "6", "--every", "2", "--keys", "10000", "--out", str(work / "soak")]
            run([str(embank), "soak", *soak], env, "embank soak (smoke)")
    say("ok")


if __name__ == "__main__":
    main()
