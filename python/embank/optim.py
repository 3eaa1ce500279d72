"""Server-side optimizers: :meth:`embank.Table.push_grad` updates rows where they live.

The optimizer's state (Adagrad's sum of squared gradients, Adam's moments and
step count) is stored in the same record as the row, so it never travels,
and is persisted, cached and recovered with the row. Updates are lazy: rows
not in a ``push_grad`` are untouched.

>>> import embank, numpy as np, tempfile, os
>>> with embank.open(os.path.join(tempfile.mkdtemp(), "m")) as store:
...     t = store.create_table("e", dim=2, init=embank.init.constant(1.0),
...                            optimizer=embank.optim.SGD(lr=0.5))
...     t.push_grad([3, 3], np.array([[1.0, 0.0], [1.0, 2.0]], np.float32))  # summed: [2, 2]
...     print(t.pull([3]).tolist())
[[0.0, 0.0]]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        from .errors import ConfigError

        raise ConfigError(f"{name} optimizer: {what}")


@dataclass(frozen=True)
class Optimizer:
    """Base class; use :class:`SGD`, :class:`Adagrad` or :class:`Adam`."""

    lr: float

    def _json(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class SGD(Optimizer):
    """``w -= lr * g``."""

    def __post_init__(self) -> None:
        _check("sgd", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")

    def _json(self) -> str:
        return json.dumps({"kind": "sgd", "lr": self.lr})


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """``s += g**2; w -= lr * g / (sqrt(s) + eps)``: PyTorch's ``Adagrad`` on sparse
    gradients (``lr_decay=0``, no weight decay)."""

    eps: float = 1e-10
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check("adagrad", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check("adagrad", self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _check(
            "adagrad",
            self.initial_accumulator_value >= 0,
            f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}",
        )

    def _json(self) -> str:
        return json.dumps(
            {
                "kind": "adagrad",
                "lr": self.lr,
                "eps": self.eps,
                "initial_accumulator_value": self.initial_accumulator_value,
            }
        )


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam with a step count per row: each row's bias correction uses the number of
    updates that row has received (lazy Adam)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        _check("adam", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        b1, b2 = self.betas
        _check("adam", 0 <= b1 < 1 and 0 <= b2 < 1, f"betas must be in [0, 1), got {self.betas}")
        _check("adam", self.eps >= 0, f"eps must be >= 0, got {self.eps}")

    def _json(self) -> str:
        b1, b2 = self.betas
        return json.dumps({"kind": "adam", "lr": self.lr, "beta1": b1, "beta2": b2, "eps": self.eps})


__all__ = ["SGD", "Adagrad", "Adam", "Optimizer"]
