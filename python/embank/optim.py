"""Server-side optimizers: :meth:`embank.Table.push_grad` updates rows where they live.

The optimizer's state (Adagrad's sum of squared gradients, row-wise Adagrad's one
accumulator, Adam's moments and step count, FTRL's ``z`` and ``n``) is stored in the
same record as the row, so it never travels,
and is persisted, cached and recovered with the row. Updates are lazy: rows
not in a ``push_grad`` are untouched.

Two Adams, side by side. :class:`Adam` and :class:`AdamW` are embank's: each row counts
its own steps (a row updated for the 3rd time is bias-corrected with t = 3).
:class:`FbgemmAdam`, :class:`PartialRowWiseAdam`, :class:`Lamb` and
:class:`PartialRowWiseLamb` are FBGEMM's (TorchRec's ``EmbOptimType.ADAM``,
``PARTIAL_ROWWISE_ADAM``, ``LAMB``, ``PARTIAL_ROWWISE_LAMB``): every row updated in a
training step is bias-corrected with the *table's* step t, which advances every step
whether a row is in it or not. The table keeps t (:attr:`embank.Table.optimizer_step`,
recorded by each checkpoint and brought back by a restore); ``push_grad(keys, grads,
step=t)`` says which step a gradient belongs to (the torch layer passes it), and a
``push_grad`` without one is a step of its own. Served tables take the step to every
shard (``PUSH_GRAD_AT``); their ``optimizer_step`` is the newest of their shards'.

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

from .errors import ConfigError


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ConfigError(f"{name} optimizer: {what}")


@dataclass(frozen=True)
class Optimizer:
    """Base class; use :class:`SGD`, :class:`Adagrad`, :class:`RowWiseAdagrad`,
    :class:`Adam`, :class:`AdamW`, :class:`Ftrl`, or FBGEMM's :class:`FbgemmAdam`,
    :class:`PartialRowWiseAdam`, :class:`Lamb`, :class:`PartialRowWiseLamb`."""

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


@dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """FBGEMM's exact row-wise Adagrad (``EmbOptimType.EXACT_ROWWISE_ADAGRAD``, TorchRec's
    default): ``s += mean(g**2); w -= lr * g / (sqrt(s) + eps)`` with one accumulator
    ``s`` per row, so the state is one float per row instead of ``dim``."""

    eps: float = 1e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check("rowwise_adagrad", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        _check("rowwise_adagrad", self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _check(
            "rowwise_adagrad",
            self.initial_accumulator_value >= 0,
            f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}",
        )

    def _json(self) -> str:
        return json.dumps(
            {
                "kind": "rowwise_adagrad",
                "lr": self.lr,
                "eps": self.eps,
                "initial_accumulator_value": self.initial_accumulator_value,
            }
        )


@dataclass(frozen=True)
class AdamW(Optimizer):
    """:class:`Adam` (a step count per row) with PyTorch's decoupled weight decay:
    ``w *= 1 - lr * weight_decay`` before each row's Adam step."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        _check("adamw", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        b1, b2 = self.betas
        _check("adamw", 0 <= b1 < 1 and 0 <= b2 < 1, f"betas must be in [0, 1), got {self.betas}")
        _check("adamw", self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _check(
            "adamw",
            math.isfinite(self.weight_decay) and self.weight_decay >= 0 and self.lr * self.weight_decay < 1,
            f"weight_decay must be >= 0 with lr * weight_decay < 1, got {self.weight_decay}",
        )

    def _json(self) -> str:
        b1, b2 = self.betas
        fields = {"lr": self.lr, "beta1": b1, "beta2": b2, "eps": self.eps, "weight_decay": self.weight_decay}
        return json.dumps({"kind": "adamw", **fields})


@dataclass(frozen=True)
class Ftrl(Optimizer):
    """FTRL-Proximal (McMahan et al., 2013), per coordinate, the CTR staple:
    ``sigma = (sqrt(n + g**2) - sqrt(n)) / lr; z += g - sigma * w; n += g**2;
    w = 0 if |z| <= l1 else -(z - sign(z) * l1) / ((beta + sqrt(n)) / lr + l2)``.
    ``l1`` makes rows sparse (exact zeros). ``n`` starts at ``initial_accumulator_value``
    (TensorFlow's default 0.1), ``z`` at 0."""

    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    initial_accumulator_value: float = 0.1

    def __post_init__(self) -> None:
        _check("ftrl", math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        for name, v in (("beta", self.beta), ("l1", self.l1), ("l2", self.l2)):
            _check("ftrl", math.isfinite(v) and v >= 0, f"{name} must be >= 0, got {v}")
        _check(
            "ftrl",
            self.initial_accumulator_value >= 0,
            f"initial_accumulator_value must be >= 0, got {self.initial_accumulator_value}",
        )
        _check(
            "ftrl",
            self.beta > 0 or self.l2 > 0 or self.initial_accumulator_value > 0,
            "beta, l2 and initial_accumulator_value are all 0: the first update divides by 0",
        )

    def _json(self) -> str:
        return json.dumps(
            {
                "kind": "ftrl",
                "lr": self.lr,
                "beta": self.beta,
                "l1": self.l1,
                "l2": self.l2,
                "initial_accumulator_value": self.initial_accumulator_value,
            }
        )


@dataclass(frozen=True)
class _TableStep(Optimizer):
    """FBGEMM's optimizers bias-corrected with the table's training step t (see the
    module's doc): ``betas``, ``eps`` (FBGEMM's default 1e-8) and ``weight_decay``, which
    FBGEMM's kernels apply decoupled, ``lr * weight_decay * w`` taken with the step."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    _kind = ""

    def __post_init__(self) -> None:
        k = self._kind
        _check(k, math.isfinite(self.lr) and self.lr > 0, f"lr must be > 0, got {self.lr}")
        b1, b2 = self.betas
        _check(k, 0 <= b1 < 1 and 0 <= b2 < 1, f"betas must be in [0, 1), got {self.betas}")
        _check(k, math.isfinite(self.eps) and self.eps >= 0, f"eps must be >= 0, got {self.eps}")
        _check(
            k,
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"weight_decay must be >= 0, got {self.weight_decay}",
        )

    def _json(self) -> str:
        b1, b2 = self.betas
        fields = {"lr": self.lr, "beta1": b1, "beta2": b2, "eps": self.eps, "weight_decay": self.weight_decay}
        return json.dumps({"kind": self._kind, **fields})


@dataclass(frozen=True)
class FbgemmAdam(_TableStep):
    """FBGEMM's Adam (``EmbOptimType.ADAM``), with the table's step t:
    ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g**2;
    w -= lr * (m/(1-b1**t) / (sqrt(v/(1-b2**t)) + eps) + weight_decay*w)``."""

    _kind = "fbgemm_adam"


@dataclass(frozen=True)
class PartialRowWiseAdam(_TableStep):
    """FBGEMM's ``PARTIAL_ROWWISE_ADAM``: :class:`FbgemmAdam` with one second moment per
    row, ``v = b2*v + (1-b2)*mean(g**2)`` (state: ``dim + 1`` floats a row)."""

    _kind = "partial_rowwise_adam"


@dataclass(frozen=True)
class Lamb(_TableStep):
    """FBGEMM's ``LAMB``: Adam's moments with the table's step t, then
    ``r = m/(1-b1**t) / (sqrt(v/(1-b2**t)) + eps) + weight_decay*w;
    w -= lr * (norm(w) / norm(r)) * r``, one trust ratio a row (a row of zeros never
    moves, as in FBGEMM)."""

    _kind = "lamb"


@dataclass(frozen=True)
class PartialRowWiseLamb(_TableStep):
    """FBGEMM's ``PARTIAL_ROWWISE_LAMB``: :class:`Lamb` with one second moment per row,
    ``v = b2*v + (1-b2)*mean(g**2)``."""

    _kind = "partial_rowwise_lamb"


__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "FbgemmAdam",
    "Ftrl",
    "Lamb",
    "Optimizer",
    "PartialRowWiseAdam",
    "PartialRowWiseLamb",
    "RowWiseAdagrad",
]
