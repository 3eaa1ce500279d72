"""``python -m embank`` and the ``embank`` script: the command line of embank.

The command is a program of its own (``embank/bin/embank``, from the crate embank-cli):
the extension the package imports links no command-line parsing, plots or benchmark.
Run as a script, this module replaces itself with that program (``exec``), so signals
and the exit status are the program's own: ``kill`` reaches ``embank serve`` itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Where a build put the program: a link into the cargo target directory after
# `make develop`, the program itself in a wheel. EMBANK_BIN overrides it.
BUNDLED = Path(__file__).resolve().parent / "bin" / "embank"


def program() -> str:
    """The path of the ``embank`` program; a clear error if this install has none."""
    path = os.environ.get("EMBANK_BIN") or str(BUNDLED)
    if not os.access(path, os.X_OK):
        raise SystemExit(
            f"embank: the embank program is not in this install ({path}). `make develop` (or"
            " `make demo`) builds it; from a source checkout without make, run `cargo build"
            " --release -p embank-cli` and set EMBANK_BIN=target/release/embank."
        )
    return path


def main(argv: list[str] | None = None) -> int:
    """Runs the command line with ``argv`` (``sys.argv[1:]`` when None).

    Without ``argv`` (the script, ``python -m embank``) this process becomes the program
    and never returns; with ``argv`` it runs the program as a child and returns its exit
    status.
    """
    exe = program()
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    sys.stderr.flush()
    if argv is None:
        os.execv(exe, ["embank", *args])
    return subprocess.call([exe, *args])


if __name__ == "__main__":
    sys.exit(main())
