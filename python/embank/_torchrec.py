"""What TorchRec users bring along: table configs, fused-optimizer specs, ``KeyedTensor``
and ``JaggedTensor`` outputs. Imported by :mod:`embank.torch`; TorchRec itself is
optional (its own classes are used when it is installed). State dicts in TorchRec's
layout are in ``_state.py``.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch

from . import init as embank_init
from . import optim
from ._store import Store
from ._table import Table
from .errors import ConfigError

__all__ = [
    "EmbeddingBagConfig",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "optimizer_from_spec",
]


class PoolingType(enum.Enum):
    """TorchRec's pooling names (``torchrec.PoolingType`` is accepted as well)."""

    SUM = "SUM"
    MEAN = "MEAN"


@dataclass
class EmbeddingConfig:
    """TorchRec's ``EmbeddingConfig`` (an unpooled table, for
    :class:`~embank.torch.EmbeddingCollection`) with the fields embank reads, for use
    without TorchRec: ``num_embeddings`` (ids ``0..num_embeddings-1``: the table's
    capacity and the rows of its state dict), ``embedding_dim``, ``name``,
    ``feature_names`` and the uniform initializer's bounds (default, as TorchRec's:
    ``±sqrt(1 / num_embeddings)``)."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None

    def get_weight_init_max(self) -> float:
        return math.sqrt(1 / self.num_embeddings) if self.weight_init_max is None else self.weight_init_max

    def get_weight_init_min(self) -> float:
        return -math.sqrt(1 / self.num_embeddings) if self.weight_init_min is None else self.weight_init_min

    def num_features(self) -> int:
        return len(self.feature_names)


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """TorchRec's ``EmbeddingBagConfig``: :class:`EmbeddingConfig` and ``pooling``
    (:class:`PoolingType` or ``"sum"``/``"mean"``)."""

    pooling: PoolingType | str = PoolingType.SUM


def pooling_mode(config: Any) -> str:
    """``"sum"`` or ``"mean"`` from a config's ``pooling`` (an enum of either kind or a
    string). A config without one (TorchRec's ``EmbeddingConfig``: an unpooled table,
    one row per id) is refused: pooling it would be a different model."""
    if not hasattr(config, "pooling"):
        raise ConfigError(
            f"table {getattr(config, 'name', '')!r}: a {type(config).__name__} has no pooling: it is an "
            "unpooled table of TorchRec's EmbeddingCollection (one row per id, a JaggedTensor out), "
            "not of an EmbeddingBagCollection: use embank.torch.EmbeddingCollection.from_configs"
        )
    p = config.pooling
    name = str(getattr(p, "value", p)).lower()
    if name not in ("sum", "mean"):
        raise ConfigError(f"table {config.name!r}: pooling {p!r} is not supported (SUM or MEAN)")
    return name


def init_bounds(config: Any) -> tuple[float, float]:
    """The uniform initializer's ``(low, high)`` of a config, as TorchRec computes them."""
    if hasattr(config, "get_weight_init_min"):
        return float(config.get_weight_init_min()), float(config.get_weight_init_max())
    bound = math.sqrt(1 / config.num_embeddings)
    return -bound, bound


class KeyedTensor:
    """TorchRec's ``KeyedTensor`` for use without TorchRec: the pooled embeddings of
    several features side by side in one ``(batch, sum(dims))`` tensor."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = keys, length_per_key, values

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._lengths

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths).tolist()]

    def key_dim(self) -> int:
        return 1

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(zip(self._keys, torch.split(self._values, self._lengths, dim=1)))

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._keys.index(key)
        start = sum(self._lengths[:i])
        return self._values[:, start : start + self._lengths[i]]

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths})"


class JaggedTensor:
    """TorchRec's ``JaggedTensor`` for use without TorchRec: ``values`` (one row per id)
    in bags of ``lengths``."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._values, self._lengths = values, lengths

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([self._lengths.new_zeros(1), torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> None:
        return None

    def to_dense(self) -> list[torch.Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, lengths={self._lengths.tolist()})"


def jagged_tensor_class() -> Any:
    """TorchRec's ``JaggedTensor`` when TorchRec is installed, else :class:`JaggedTensor`."""
    if importlib.util.find_spec("torchrec") is not None:
        return importlib.import_module("torchrec.sparse.jagged_tensor").JaggedTensor
    return JaggedTensor


def keyed_tensor_class() -> Any:
    """TorchRec's ``KeyedTensor`` when TorchRec is installed, else :class:`KeyedTensor`."""
    if importlib.util.find_spec("torchrec") is not None:
        return importlib.import_module("torchrec.sparse.jagged_tensor").KeyedTensor
    return KeyedTensor


# --- optimizers -------------------------------------------------------------------

Spec = Union[optim.Optimizer, Mapping[str, Any], tuple[Any, Mapping[str, Any]], str, Any]

_KINDS = {
    "exact_rowwise_adagrad": "rowwise_adagrad",
    "rowwise_adagrad": "rowwise_adagrad",
    "exact_adagrad": "adagrad",
    "adagrad": "adagrad",
    "exact_sgd": "sgd",
    "sgd": "sgd",
    "adamw": "adamw",
    "ftrl": "ftrl",
    # FBGEMM's, bias-corrected with the table's step (EmbOptimType.ADAM is "adam").
    "adam": "fbgemm_adam",
    "partial_rowwise_adam": "partial_rowwise_adam",
    "lamb": "lamb",
    "partial_rowwise_lamb": "partial_rowwise_lamb",
}
#: FBGEMM's default ``eps`` (``SplitTableBatchedEmbeddingBagsCodegen(eps=1.0e-8)``), which
#: its (row-wise) Adagrad, Adam and LAMB use when a spec gives none; embank.optim.Adagrad's
#: own default is PyTorch's 1e-10.
FBGEMM_EPS = 1e-8
_SUPPORTED = (
    "EmbOptimType.EXACT_ROWWISE_ADAGRAD (or ROWWISE_ADAGRAD), EXACT_ADAGRAD, EXACT_SGD (or SGD), "
    'ADAM, PARTIAL_ROWWISE_ADAM, LAMB, PARTIAL_ROWWISE_LAMB; the names "adamw" and "ftrl"; or an '
    "embank.optim optimizer (SGD, Adagrad, RowWiseAdagrad, Adam, AdamW, Ftrl, FbgemmAdam, "
    "PartialRowWiseAdam, Lamb, PartialRowWiseLamb)"
)
# fused_params keys that tune FBGEMM's kernels or caches, not the update rule.
_NOT_OPTIMIZER = {
    "stochastic_rounding",
    "output_dtype",
    "cache_load_factor",
    "cache_precision",
    "cache_algorithm",
    "cache_reserved_memory",
    "prefetch_pipeline",
    "gradient_clipping",
    "max_gradient",
    "pooling_mode",
    "embedding_location",
}
_PARAMETERS = {
    "sgd": {"lr"},
    "adagrad": {"lr", "eps", "initial_accumulator_value"},
    "rowwise_adagrad": {"lr", "eps", "initial_accumulator_value"},
    "adamw": {"lr", "beta1", "beta2", "eps", "weight_decay"},
    "ftrl": {"lr", "beta", "l1", "l2", "initial_accumulator_value"},
    **{
        k: {"lr", "beta1", "beta2", "eps", "weight_decay", "weight_decay_mode"}
        for k in ("fbgemm_adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
    },
}
_TABLE_STEP = {
    "fbgemm_adam": optim.FbgemmAdam,
    "partial_rowwise_adam": optim.PartialRowWiseAdam,
    "lamb": optim.Lamb,
    "partial_rowwise_lamb": optim.PartialRowWiseLamb,
}
# FBGEMM's Adam and LAMB kernels take weight decay one way, decoupled, whatever the mode
# says; the modes that change other things (counters, global decay) are refused.
_WEIGHT_DECAY_MODES = {"none", "l2", "decouple"}


def _kind(name: Any) -> str:
    """embank's optimizer kind of an ``EmbOptimType``, a torch optimizer class or a name."""
    if isinstance(name, type):  # torch.optim.SGD, torchrec.optim.RowWiseAdagrad, ...
        name = name.__name__
    text = str(getattr(name, "value", name)).lower()
    text = text.rsplit(".", 1)[-1].replace("row_wise", "rowwise").replace("-", "_")
    text = {"rowwiseadagrad": "rowwise_adagrad"}.get(text, text)
    # EmbOptimType.ADAM, torch.optim.Adam (FusedEmbeddingBagCollection's), "adam": FBGEMM's
    # Adam, bias-corrected with the table's step (embank.optim.Adam counts steps per row).
    if text not in _KINDS:
        raise ConfigError(f"optimizer {name!r} is not supported by embank; use {_SUPPORTED}")
    return _KINDS[text]


def optimizer_from_spec(spec: Spec) -> optim.Optimizer:
    """An embank optimizer from what a TorchRec user writes for a fused one:

    - an :class:`embank.optim.Optimizer`, returned as it is;
    - ``(EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"lr": 0.02, "eps": 1e-8})`` (the type may be
      a name such as ``"exact_rowwise_adagrad"``, ``"adagrad"``, ``"sgd"``, ``"adamw"``,
      ``"ftrl"``, or a torch optimizer class as ``FusedEmbeddingBagCollection`` takes);
    - TorchRec's ``fused_params``: ``{"optimizer": EmbOptimType..., "learning_rate": 0.02,
      "eps": 1e-8}``.

    ``lr``/``learning_rate``, ``eps`` (FBGEMM's default, 1e-8, when not given, for
    Adagrad, row-wise Adagrad and FBGEMM's Adam and LAMB kinds), ``beta1``/``beta2`` (or
    ``betas``), ``weight_decay`` (and ``weight_decay_mode``: NONE, L2 or DECOUPLE, which
    FBGEMM's Adam and LAMB kernels all apply the decoupled way) and FTRL's ``beta``,
    ``l1``, ``l2``, ``initial_accumulator_value`` are read; keys that tune FBGEMM's kernels
    (``stochastic_rounding``, ``cache_*``, ``output_dtype``) are ignored; anything else
    raises :class:`~embank.errors.ConfigError` rather than being dropped silently (a
    ``weight_decay`` on Adagrad, say).

    FBGEMM's Adam (``EmbOptimType.ADAM``, ``torch.optim.Adam``, ``"adam"``),
    ``PARTIAL_ROWWISE_ADAM``, ``LAMB`` and ``PARTIAL_ROWWISE_LAMB`` map to
    :class:`~embank.optim.FbgemmAdam`, :class:`~embank.optim.PartialRowWiseAdam`,
    :class:`~embank.optim.Lamb` and :class:`~embank.optim.PartialRowWiseLamb`: their bias
    correction uses the table's training step, as FBGEMM's (embank's own
    :class:`~embank.optim.Adam` counts steps per row: pass it to use that). Optimizers
    embank does not implement (LARS_SGD, ...) are refused."""
    if isinstance(spec, optim.Optimizer):
        return spec
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ConfigError(f"an optimizer spec tuple is (type, kwargs), got {spec!r}")
        kind, params = _kind(spec[0]), dict(spec[1])
    elif isinstance(spec, Mapping):
        params = dict(spec)
        if "optimizer" not in params:
            raise ConfigError(f'fused_params need an "optimizer" entry, got keys {sorted(params)}')
        kind = _kind(params.pop("optimizer"))
    else:
        kind, params = _kind(spec), {}
    if "learning_rate" in params:
        params["lr"] = params.pop("learning_rate")
    if "betas" in params:
        params["beta1"], params["beta2"] = params.pop("betas")
    for k in list(params):
        if k in _NOT_OPTIMIZER:
            del params[k]
    # Zero-valued extras are what FBGEMM's defaults say anyway.
    for k in ("weight_decay", "momentum"):
        if k in params and k not in _PARAMETERS[kind] and not params[k]:
            del params[k]
    unknown = sorted(set(params) - _PARAMETERS[kind])
    if unknown:
        raise ConfigError(f"{kind} optimizer: parameters {unknown} are not supported")
    if "lr" not in params:
        raise ConfigError(f"{kind} optimizer: a learning rate (lr or learning_rate) is needed")
    lr = float(params.pop("lr"))
    if "weight_decay_mode" in params:
        mode = params.pop("weight_decay_mode")
        text = str(getattr(mode, "name", mode)).lower()
        if text not in _WEIGHT_DECAY_MODES:
            raise ConfigError(
                f"{kind} optimizer: weight_decay_mode {mode!r} is not supported (NONE, L2 or DECOUPLE: "
                "FBGEMM's Adam and LAMB kernels apply every one of them as decoupled weight decay)"
            )
    args = {k: float(v) for k, v in params.items()}
    if kind in _TABLE_STEP:
        b1, b2 = args.pop("beta1", 0.9), args.pop("beta2", 0.999)
        args.setdefault("eps", FBGEMM_EPS)
        table_step: optim.Optimizer = _TABLE_STEP[kind](lr, (b1, b2), **args)
        return table_step
    if kind in ("adagrad", "rowwise_adagrad"):
        args.setdefault("eps", FBGEMM_EPS)
    if kind == "adamw":
        b1, b2 = args.pop("beta1", 0.9), args.pop("beta2", 0.999)
        return optim.AdamW(lr, (b1, b2), **args)
    cls = {
        "sgd": optim.SGD,
        "adagrad": optim.Adagrad,
        "rowwise_adagrad": optim.RowWiseAdagrad,
        "ftrl": optim.Ftrl,
    }[kind]
    made: optim.Optimizer = cls(lr, **args)
    return made


def table_for_config(
    store: Store, config: Any, optimizer: optim.Optimizer | None, table_options: Mapping[str, Any]
) -> Table:
    """Opens the table of ``config`` in ``store`` (its dim checked) or creates it:
    ``num_embeddings`` as capacity, TorchRec's uniform initializer, ``missing="init"``."""
    name = config.name
    if not name:
        raise ConfigError("an EmbeddingBagConfig needs a name (the table's)")
    if name in store:
        table = store.table(name)
        if table.dim != config.embedding_dim:
            raise ConfigError(
                f"table {name!r} exists with dim {table.dim}, the config says {config.embedding_dim}"
            )
        have = table.optimizer
        want = None if optimizer is None else json.loads(optimizer._json())
        if want is not None and (have is None or have["kind"] != want["kind"]):
            raise ConfigError(f"table {name!r} exists with optimizer {have}, the spec says {want}")
        return table
    low, high = init_bounds(config)
    options: dict[str, Any] = {
        "capacity": max(int(config.num_embeddings), 1),
        "init": embank_init.uniform(low, high),
        "missing": "init",
        "optimizer": optimizer,
        **table_options,
    }
    return store.create_table(name, int(config.embedding_dim), **options)
