"""``python -m embank`` and the ``embank`` script: the command line of embank."""

from __future__ import annotations

import sys

from . import _native


def main(argv: list[str] | None = None) -> int:
    args = ["embank", *(sys.argv[1:] if argv is None else argv)]
    sys.stdout.flush()
    return _native.cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
