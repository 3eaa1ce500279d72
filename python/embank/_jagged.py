"""The input of the modules of :mod:`embank.torch`: ids as embank keys, and keyed jagged
features — TorchRec's ``KeyedJaggedTensor`` (read from its flat values and offsets), a
mapping ``name -> (values, offsets[, per_sample_weights])``, or a ``(batch, features)``
tensor of one id per feature — read as every feature's ids, bag starts and weights
(:class:`Features`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .errors import InvalidInputError

Jagged = Mapping[str, Sequence[Any]]


def _to_keys(ids: torch.Tensor, what: str) -> npt.NDArray[np.uint64]:
    a = _ids64(ids, what)
    if a.size and a.min() < 0:
        raise InvalidInputError(f"{what} holds a negative id ({int(a.min())}); embank keys are >= 0")
    return a.astype(np.uint64)


def _np(t: Any, dtype: torch.dtype) -> Any:
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", dtype).numpy()
    return np.asarray(t)


def _ids64(t: Any, what: str) -> npt.NDArray[np.int64]:
    if isinstance(t, torch.Tensor) and t.dtype not in (
        torch.int64,
        torch.int32,
        torch.int16,
        torch.uint8,
        torch.int8,
    ):
        raise InvalidInputError(f"{what} must be an integer tensor, got {t.dtype}")
    a = _np(t, torch.int64)
    if a.dtype.kind not in "iu":
        raise InvalidInputError(f"{what} must be integers, got {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _kjt_inputs(
    kjt: Any, names: list[str]
) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[torch.Tensor | None]] | None:
    """Every feature's ``(values, offsets, weights)`` straight from a TorchRec
    ``KeyedJaggedTensor``'s flat values and offsets (no per-feature tensors; the weights
    are slices of the KJT's own, so their gradient reaches it); None for anything else
    (or a KJT whose features have batches of different sizes)."""
    if not (hasattr(kjt, "length_per_key") and hasattr(kjt, "offsets") and hasattr(kjt, "stride")):
        return None
    if getattr(kjt, "variable_stride_per_key", lambda: False)():
        return None
    position = {k: i for i, k in enumerate(kjt.keys())}
    missing = [n for n in names if n not in position]
    if missing:
        raise InvalidInputError(f"features missing from the input: {missing}")
    stride = int(kjt.stride())
    values = _ids64(kjt.values(), "values of the KeyedJaggedTensor")
    offsets = _ids64(kjt.offsets(), "offsets of the KeyedJaggedTensor")
    w = kjt.weights_or_none()
    out_v: list[npt.NDArray[np.int64]] = []
    out_o: list[npt.NDArray[np.int64]] = []
    out_w: list[torch.Tensor | None] = []
    for name in names:
        f = position[name]
        o = offsets[f * stride : (f + 1) * stride + 1]
        lo, hi = int(o[0]), int(o[-1])
        out_v.append(values[lo:hi])
        out_o.append(o[:-1] - lo)
        out_w.append(None if w is None else w[lo:hi])
    return out_v, out_o, out_w


def _as_jagged(features: Any) -> Jagged:
    if isinstance(features, Mapping):
        return features
    # TorchRec's KeyedJaggedTensor, without importing torchrec.
    if hasattr(features, "to_dict") and hasattr(features, "keys"):
        d = features.to_dict()
        return {k: (jt.values(), jt.offsets()[:-1], jt.weights_or_none()) for k, jt in d.items()}
    raise InvalidInputError(
        f"expected a KeyedJaggedTensor or a mapping name -> (values, offsets), got {type(features).__name__}"
    )


class Features:
    """How a collection reads its input: its features' ``names`` in order, each one's
    pooling (``modes``), the weights as ``is_weighted`` says (TorchRec's: ``False``
    ignores the input's, ``True`` requires them, ``None`` uses them where given) and,
    for a collection made from TorchRec's configs, each feature's ``num_embeddings`` its
    ids must be below and its table (``id_bounds``)."""

    def __init__(self, names: list[str], modes: list[str], is_weighted: bool | None) -> None:
        self.names = names
        self.modes = modes
        self.is_weighted = is_weighted
        # Features pooling differently: the engine sums, MEAN bags weighted by 1 / length.
        self.mixed = len(set(modes)) > 1
        self.id_bounds: list[tuple[int, str]] | None = None

    def jagged(self, features: Any) -> Jagged:
        jagged = _as_jagged(features)
        missing = [n for n in self.names if n not in jagged]
        if missing:
            raise InvalidInputError(f"features missing from the input: {missing}")
        return jagged

    def inputs(
        self, features: Any
    ) -> tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]], list[torch.Tensor | None]]:
        """Every feature's ids, bag starts and weights (as given: a tensor whose gradient
        is wanted stays one), the weights as ``is_weighted`` says."""
        if isinstance(features, torch.Tensor):
            if features.dim() != 2 or features.shape[1] != len(self.names):
                raise InvalidInputError(
                    f"a tensor of ids must be (batch, {len(self.names)}): one id per feature "
                    f"per example; got shape {tuple(features.shape)}"
                )
            ids = _ids64(features, "ids").T.copy()  # one contiguous row per feature
            starts = np.arange(ids.shape[1], dtype=np.int64)
            return self.bounded(list(ids)), [starts] * len(ids), self.weights([None] * len(ids))
        fast = _kjt_inputs(features, self.names)
        if fast is not None:
            values, offsets, given = fast
            return self.bounded(values), offsets, self.weights(given)
        jagged = self.jagged(features)
        values, offsets, given = [], [], []
        for name in self.names:
            v, o, *w = jagged[name]
            values.append(_ids64(v, f"values of {name!r}"))
            offsets.append(_ids64(o, f"offsets of {name!r}"))
            wt = w[0] if w else None
            given.append(wt if wt is None or isinstance(wt, torch.Tensor) else torch.as_tensor(wt))
        return self.bounded(values), offsets, self.weights(given)

    def bounded(self, values: list[npt.NDArray[np.int64]]) -> list[npt.NDArray[np.int64]]:
        """``values``, checked against the configs' ``num_embeddings`` (from_configs)."""
        if self.id_bounds is None:
            return values
        for name, v, (bound, table) in zip(self.names, values, self.id_bounds):
            if len(v) and (top := int(v.max())) >= bound:
                raise InvalidInputError(
                    f"feature {name!r}: id {top} is not below num_embeddings {bound} of table {table!r} "
                    "(TorchRec's collection refuses it too); from_configs(..., "
                    "allow_ids_beyond_num_embeddings=True) lets the table grow past it"
                )
        return values

    def weights(self, given: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The weights pooling uses: none with ``is_weighted=False`` (TorchRec's unweighted
        collection ignores a KJT's weights), every feature's with ``is_weighted=True``."""
        if self.is_weighted is False:
            return [None] * len(given)
        for name, mode, w in zip(self.names, self.modes, given):
            if w is None and self.is_weighted:
                raise InvalidInputError(
                    f"feature {name!r} has no weights: the collection is weighted (is_weighted=True)"
                )
            if w is not None and mode != "sum":
                raise InvalidInputError(
                    f'feature {name!r}: per_sample_weights need mode="sum" (as in torch.nn.EmbeddingBag)'
                )
        return given

    def native_weights(
        self,
        values: list[npt.NDArray[np.int64]],
        offsets: list[npt.NDArray[np.int64]],
        given: list[torch.Tensor | None],
    ) -> list[npt.NDArray[np.float32] | None]:
        """The weights the engine pools with: the given ones, and in a collection whose
        features pool differently (the engine sums) ``1 / length`` for each MEAN bag's ids."""
        out: list[npt.NDArray[np.float32] | None] = []
        for v, o, w, mode in zip(values, offsets, given, self.modes):
            if self.mixed and mode == "mean":
                lengths = np.diff(np.append(o, len(v)))
                out.append(np.repeat(1 / np.maximum(lengths, 1), lengths).astype(np.float32))
            else:
                out.append(None if w is None else np.ascontiguousarray(_np(w, torch.float32), np.float32))
        return out
