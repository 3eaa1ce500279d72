"""Initializers: the value of rows never written.

Deterministic per ``(seed, key)``: two stores created alike agree on every
never-written row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Initializer:
    kind: str
    a: float = 0.0
    b: float = 0.0

    def _options(self) -> dict[str, object]:
        """The initializer as the engine's table options spell it."""
        fields = {"zeros": (), "constant": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std")}
        names = fields[self.kind]
        return {"kind": self.kind, **dict(zip(names, (self.a, self.b)))}


def zeros() -> Initializer:
    """All zeros (the default)."""
    return Initializer("zeros")


def constant(value: float) -> Initializer:
    """Every element ``value``."""
    return Initializer("constant", float(value))


def uniform(low: float, high: float) -> Initializer:
    """Uniform in ``[low, high)``."""
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ConfigError(f"uniform initializer needs finite low < high, got low={low} high={high}")
    return Initializer("uniform", float(low), float(high))


def normal(mean: float = 0.0, std: float = 0.01) -> Initializer:
    """Normal with ``mean`` and standard deviation ``std``."""
    if not (math.isfinite(mean) and math.isfinite(std) and std >= 0):
        raise ConfigError(f"normal initializer needs finite mean and std >= 0, got mean={mean} std={std}")
    return Initializer("normal", float(mean), float(std))


__all__ = ["Initializer", "constant", "normal", "uniform", "zeros"]
