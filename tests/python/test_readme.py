"""Every fenced block of README.md and deploy/README.md, as a reader would run it.

README.md: python blocks run in this venv's python and shell blocks in bash (``set -e``),
one after another in one temporary directory, as a reader following the README does;
``embank`` and ``python`` are this venv's. A shell block that starts a server in the
background (``... --listen HOST:PORT &``) leaves it running for the blocks after it (the
test waits until the port accepts, as a reader waits for "listening on"); it is stopped
when the file is done. A ``print(...)  # shown`` must print what its comment shows. Each
block is a test of its own, named by its file and line.

Two README blocks are not executed, by exact content: the set-up commands (``make demo``,
``make test``: this test runs inside ``make test``) and the install commands (``pip install
embank``: they need a package index and would replace this tree's build in the venv).
What they name is checked instead. A python block importing PyTorch or TorchRec is skipped
where they are not installed, as the torch tests are.

deploy/README.md: its commands build images with Docker and create objects in a
Kubernetes cluster, neither of which a test machine has (tests/python/test_deploy.py
validates the manifests offline). Checked instead: bash syntax; ``make`` targets that
exist; ``embank`` commands, run; files given to ``docker build -f``, ``kubectl apply -f``
and ``--from-file=`` (after the ``embank`` commands) that exist; image tags, build
arguments, secrets and their keys, and the StatefulSet named as the manifests use them.

The README's API table is checked too: every call it shows names parameters the function
has, with the defaults it has.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FILES = ("README.md", "deploy/README.md")
SHELL = ("sh", "bash", "shell", "")

# Not executed (see the module's doc); matched exactly, so an edit to either is seen here.
SETUP = (
    "make demo    # builds embank and runs `embank demo`: a few million rows, Zipf pulls, reopen timing\n"
    "make test    # every check: rustfmt, clippy, Rust tests (incl. SIGKILL crash tests, "
    "real Kafka and Redis), Python lint, types, pytest\n"
)
INSTALL = """\
pip install embank              # the store and the `embank` command; numpy is its one dependency
pip install "embank[torch]"     # with PyTorch, for embank.torch
"""
# Modules a python block may need that `make demo`'s venv lacks: the block is skipped
# without them. Any other missing module fails the block.
OPTIONAL_MODULES = {"torch", "torchrec", "fbgemm_gpu"}


@dataclass
class Block:
    file: str
    line: int  # of the opening fence
    language: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def blocks(file: str) -> list[Block]:
    """The fenced blocks of ``file``, in order."""
    found: list[Block] = []
    lines = (ROOT / file).read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.fullmatch(r"```(\S*)\s*", lines[i])
        if m is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{file}:{i + 1}: a fence that is not closed"
        found.append(Block(file, i + 1, m.group(1), "".join(x + "\n" for x in lines[i + 1 : end])))
        i = end + 1
    return found


ALL = [b for f in FILES for b in blocks(f)]


def env() -> dict[str, str]:
    """A reader's environment: this venv first on PATH, no TLS files from the test session
    (conftest sets EMBANK_TLS_CA_FILE for its own servers)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("EMBANK_TLS_")}
    e["PATH"] = f"{BIN}{os.pathsep}{e.get('PATH', '')}"
    e["VIRTUAL_ENV"] = str(BIN.parent)
    e["EMBANK_LOG"] = "warn"
    return e


def accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def listens(block: Block) -> list[tuple[str, int]]:
    """The addresses servers started in the background by ``block`` listen on."""
    out = []
    for line in block.text.splitlines():
        m = re.search(r"--listen\s+(\S+):(\d+)\b.*&\s*(#.*)?$", line)
        if m:
            out.append((m.group(1), int(m.group(2))))
    return out


@dataclass
class Outcome:
    failure: str | None = None
    skip: str | None = None


class Reader:
    """Runs one file's blocks in order in one directory, keeping background servers."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.shells: list[subprocess.Popen[bytes]] = []

    def run(self, b: Block) -> Outcome:
        if b.language == "python":
            return self.python(b)
        if b.language in SHELL:
            if b.file == "deploy/README.md":
                return check_deploy(b, self.work)
            if b.text == SETUP:
                return check_setup()
            if b.text == INSTALL:
                return check_install()
            return self.shell(b)
        return Outcome(
            failure=f"{b.id}: a ```{b.language} block: test_readme.py runs python and shell blocks; "
            "teach it to run or check this language"
        )

    def python(self, b: Block) -> Outcome:
        for name in imported(b.text):
            if importlib.util.find_spec(name) is None:
                if name in OPTIONAL_MODULES:
                    return Outcome(skip=f"{b.id} imports {name}, not installed here")
                return Outcome(failure=f"{b.id} imports {name}, which is not installed (nor optional)")
        script = self.work / f"block_{b.line}.py"
        script.write_text(b.text)
        r = subprocess.run(
            [sys.executable, script.name],
            cwd=self.work,
            env=env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            return Outcome(failure=f"{b.id} (python) exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        # What a print's comment shows is what it prints (the comment may go on after it).
        shown = re.findall(r"^\s*print\(.*\)\s+#\s*(.*)$", b.text, re.M)
        printed = r.stdout.splitlines()
        if len(shown) != len(printed) or any(not s.startswith(p) for s, p in zip(shown, printed)):
            return Outcome(failure=f"{b.id}: the comments show {shown}, the block printed {printed}")
        return Outcome()

    def shell(self, b: Block) -> Outcome:
        for host, port in listens(b):
            if accepts(host, port):
                return Outcome(
                    failure=f"{b.id}: {host}:{port} is taken by another process before the block runs"
                )
        done = self.work / f".block_{b.line}.done"
        log = self.work / f"block_{b.line}.log"
        # The block's background jobs stay children of this bash, which waits for them
        # after the block (so that it reaps them) until the test ends it with SIGTERM;
        # its EXIT trap stops them, on a failure of the block too.
        script = (
            "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\ntrap 'exit 0' TERM\nset -e\n"
            + b.text
            + f"touch {shlex.quote(done.name)}\nwait\n"
        )
        with log.open("wb") as out:
            p = subprocess.Popen(
                ["bash", "-c", script],
                cwd=self.work,
                env=env(),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.shells.append(p)
        deadline = time.monotonic() + 300
        while not done.exists():
            if p.poll() is not None:
                return Outcome(failure=f"{b.id} (shell) exited {p.returncode}:\n{log.read_text()}")
            if time.monotonic() > deadline:
                return Outcome(failure=f"{b.id} (shell) still running after 300 s:\n{log.read_text()}")
            time.sleep(0.05)
        for host, port in listens(b):
            deadline = time.monotonic() + 60
            while not accepts(host, port):
                if time.monotonic() > deadline:
                    return Outcome(
                        failure=f"{b.id}: nothing listens on {host}:{port} after 60 s:\n{log.read_text()}"
                    )
                time.sleep(0.05)
        return Outcome()

    def close(self) -> None:
        for p in self.shells:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.shells:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def imported(code: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module.split(".")[0])
    return names


def check_setup() -> Outcome:
    """`make demo` and `make test` are targets (not run: this test runs inside `make test`)."""
    return check_make_targets(["demo", "test"], "README.md's set-up block")


def check_make_targets(targets: list[str], where: str) -> Outcome:
    makefile = (ROOT / "Makefile").read_text()
    missing = [t for t in targets if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
    return Outcome(failure=f"{where} names make targets the Makefile lacks: {missing}" if missing else None)


def check_install() -> Outcome:
    """`pip install embank` and `"embank[torch]"`: the package's name and its extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if project["name"] != "embank" or "torch" not in project.get("optional-dependencies", {}):
        return Outcome(
            failure=f"pyproject.toml: name {project['name']!r}, extras {project.get('optional-dependencies')}"
        )
    return Outcome()


def check_deploy(b: Block, work: Path) -> Outcome:
    """What deploy/README.md's commands name, as the module's doc says."""
    r = subprocess.run(["bash", "-n", "-c", b.text], capture_output=True, text=True)
    if r.returncode != 0:
        return Outcome(failure=f"{b.id}: not valid bash: {r.stderr}")
    if importlib.util.find_spec("yaml") is None:
        return Outcome(skip=f"{b.id}: PyYAML (for the manifests) is not installed here")
    yaml: Any = importlib.import_module("yaml")

    manifests = [
        d
        for f in sorted((ROOT / "deploy/kubernetes").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    images = {c["image"] for d in manifests for c in containers(d)}
    statefulsets = {d["metadata"]["name"] for d in manifests if d["kind"] == "StatefulSet"}
    # secret name -> the files its mounts are read by (the last part of each path used)
    mounted: dict[str, set[str]] = {}
    text = "\n".join(f.read_text() for f in (ROOT / "deploy/kubernetes").glob("*.yaml"))
    for d in manifests:
        spec = pod_spec(d)
        for v in spec.get("volumes", []):
            if "secret" in v:
                paths = {
                    m["mountPath"]
                    for c in containers(d)
                    for m in c.get("volumeMounts", [])
                    if m["name"] == v["name"]
                }
                used = {f for p in paths for f in re.findall(rf"{re.escape(p)}/([\w.-]+)", text)}
                mounted.setdefault(v["secret"]["secretName"], set()).update(used)
    problems: list[str] = []
    for n, line in enumerate(b.text.splitlines(), start=b.line + 1):
        words = shlex.split(line, comments=True)
        if not words:
            continue
        where = f"deploy/README.md:{n}"
        tool = words[0]
        if tool == "make":
            out = check_make_targets(words[1:], where)
            problems += [out.failure] if out.failure else []
        elif tool == "embank":
            r = subprocess.run(words, cwd=work, env=env(), capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                problems.append(f"{where}: {line!r} exited {r.returncode}: {r.stderr}")
        elif tool == "docker":
            files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
            tags = [words[i + 1] for i, w in enumerate(words) if w == "-t"]
            args = [words[i + 1].split("=")[0] for i, w in enumerate(words) if w == "--build-arg"]
            problems += [f"{where}: no file {f}" for f in files if not (ROOT / f).is_file()]
            problems += [
                f"{where}: image {t} is in no manifest ({sorted(images)})" for t in tags if t not in images
            ]
            for f in files:
                declared = re.findall(r"^ARG\s+(\w+)", (ROOT / f).read_text(), re.M)
                problems += [f"{where}: {f} declares no ARG {a}" for a in args if a not in declared]
        elif tool == "kubectl":
            files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
            problems += [f"{where}: no file {f}" for f in files if not (ROOT / f).is_file()]
            if words[1:4] == ["create", "secret", "generic"]:
                name = words[4]
                keys = {w.split("=", 1)[1].rsplit("/", 1)[-1] for w in words if w.startswith("--from-file=")}
                keys |= {w.split("=", 2)[1] for w in words if w.startswith("--from-literal=")}
                for w in words:
                    if w.startswith("--from-file=") and not (work / w.split("=", 1)[1]).is_file():
                        problems.append(f"{where}: {w}: no such file after the embank commands above")
                if name not in mounted:
                    problems.append(f"{where}: secret {name} is mounted by no manifest ({sorted(mounted)})")
                elif not mounted[name] <= keys:
                    problems.append(
                        f"{where}: secret {name} lacks {sorted(mounted[name] - keys)} the manifests read"
                    )
            if words[1:3] == ["rollout", "status"] and words[3].split("/")[-1] not in statefulsets:
                problems.append(
                    f"{where}: no StatefulSet {words[3]} in the manifests ({sorted(statefulsets)})"
                )
        else:
            problems.append(
                f"{where}: {tool}: test_readme.py checks make, embank, docker and kubectl lines only"
            )
    return Outcome(failure="\n".join(problems) if problems else None)


def pod_spec(d: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = d.get("spec", {})
    return spec.get("template", {}).get("spec", {}) if "template" in spec else {}


def containers(d: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(d)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    """Every block's outcome, each file's blocks run in order by one reader."""
    results: dict[str, Outcome] = {}
    for f in FILES:
        reader = Reader(tmp_path_factory.mktemp(f.replace("/", "_")))
        try:
            for b in blocks(f):
                results[b.id] = reader.run(b)
        finally:
            reader.close()
    yield results


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_runs_as_written(block: Block, outcomes: dict[str, Outcome]) -> None:
    out = outcomes[block.id]
    if out.skip:
        pytest.skip(out.skip)
    if out.failure:
        pytest.fail(out.failure, pytrace=False)


def test_the_readme_shows_its_blocks() -> None:
    """The blocks this file knows by content are still there (an edit shows up here)."""
    texts = [b.text for b in blocks("README.md")]
    assert SETUP in texts and INSTALL in texts
    assert any(b.language == "python" for b in ALL) and any(b.file == "deploy/README.md" for b in ALL)


# ---- the API table --------------------------------------------------------------------


# What the table's receivers stand for; a call without one is looked up in BARE.
RECEIVERS = {"store": "embank.Store", "t": "embank.Table", "w": "embank.Worker", "p": "embank.Publisher"}
BARE = ("embank", "embank.optim", "embank.datasets", "embank.torch", "embank.gpu")
TORCH_MODULES = ("embank.torch", "embank.gpu")


def resolve(dotted: str) -> Any:
    """The object a dotted name names, importing modules on the way."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part):
            importlib.import_module(".".join(parts[: i + 1]))
        obj = getattr(obj, part)
    return obj


def api_calls() -> list[tuple[str, str, str]]:
    """``(receiver, name, arguments)`` of every call in the first column of the API table."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Python API at a glance", 1)[1]
    calls = []
    for row in re.findall(r"^\| (.*?) \| .* \|$", table, re.M):
        for span in re.findall(r"`([^`]+)`", row):
            for m in re.finditer(r"(?<![\w.])((?:\w+\.)*)(\w+)\(([^()]*)\)", span):
                calls.append((m.group(1).rstrip("."), m.group(2), m.group(3)))
    return calls


def test_the_api_table_names_real_parameters_and_defaults() -> None:
    torch = importlib.util.find_spec("torch") is not None
    bare = [m for m in BARE if torch or m not in TORCH_MODULES]
    checked, problems = 0, []
    for receiver, name, args in api_calls():
        if receiver == "" and name == "len":
            continue
        if receiver:
            dotted = RECEIVERS.get(receiver.split(".")[0], receiver.split(".")[0])
            dotted = ".".join([dotted, *receiver.split(".")[1:], name])
            if not torch and dotted.startswith(TORCH_MODULES):
                continue
        else:
            found = [f"{m}.{name}" for m in bare if hasattr(resolve(m), name)]
            if not found:
                problems.append(f"{name}(...): in none of {bare}")
                continue
            dotted = found[0]
        try:
            fn = resolve(dotted)
        except (AttributeError, ImportError) as e:
            problems.append(f"{dotted}: {e}")
            continue
        params = inspect.signature(fn).parameters
        for arg in (a.strip() for a in args.replace("\\|", "|").split(",")):
            if "=" not in arg:
                continue  # positional, or ...
            key, value = (x.strip() for x in arg.split("=", 1))
            if key not in params:
                problems.append(f"{dotted}({key}=...): no such parameter ({list(params)})")
                continue
            first = value.split("|")[0].strip()
            try:
                want = ast.literal_eval(first)
            except (ValueError, SyntaxError):
                continue  # not a literal (256 MiB, torch.float32, N, or a blank)
            have = params[key].default
            # None in the signature stands for a default the docstring gives (timeout=30).
            if have is not None and have is not inspect.Parameter.empty and have != want:
                problems.append(f"{dotted}({key}={first}): the default is {have!r}")
        checked += 1
    assert checked >= 30, f"checked {checked} calls of the API table: did its layout change?"
    assert not problems, "\n".join(problems)
