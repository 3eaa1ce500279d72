#!/bin/sh
# The linker `make wheel` gives the extension: Zig's cc targeting glibc
# $EMBANK_WHEEL_GLIBC (from PyPI's ziglang in $EMBANK_WHEEL_VENV), through maturin's
# wrapper of it, which drops the arguments zig cc does not take: what `maturin build
# --zig` links with. Only this last link differs from the build `make demo` made, so the
# wheel reuses every crate compiled in target/release. (`--zig` itself builds them all
# again: its `--target` and linker are part of every crate's fingerprint.)
: "${EMBANK_WHEEL_VENV:?set by make wheel}" "${EMBANK_WHEEL_GLIBC:?set by make wheel}"
export CARGO_ZIGBUILD_ZIG_COMMAND="$EMBANK_WHEEL_VENV/bin/python"
export CARGO_ZIGBUILD_ZIG_COMMAND_ARGS='-m ziglang'
exec "$EMBANK_WHEEL_VENV/bin/maturin" zig cc -- -g -fno-sanitize=all \
  -target "$(uname -m)-linux-gnu.$EMBANK_WHEEL_GLIBC" "$@"
