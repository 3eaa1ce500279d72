"""``python -m embank`` and the ``embank`` script: the command line of embank."""

from __future__ import annotations

import os
import sys

from . import _native


def main(argv: list[str] | None = None) -> int:
    args = ["embank", *(sys.argv[1:] if argv is None else argv)]
    # Subcommands that start embank again (bench-recovery, soak, bench-stream) run this
    # interpreter as Python names it: a venv's `python`, not the base one it links to.
    if sys.executable:
        os.environ["EMBANK_PYTHON"] = sys.executable
    sys.stdout.flush()
    return _native.cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
