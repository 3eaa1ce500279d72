"""PyTorch modules whose embedding tables live in embank.

The rows are never a ``torch.nn.Parameter``: forward pulls the unique rows of the
batch from the store, pools them in torch, and backward hands the gradient of each
unique row to the table's own optimizer (``push_grad``). Dense optimizers never see
the tables; the optimizer state lives with the rows, larger than memory if need be.

>>> import embank, embank.torch, torch, tempfile, os
>>> store = embank.open(os.path.join(tempfile.mkdtemp(), "m"))
>>> items = store.create_table("item", dim=4, init=embank.init.constant(0.1),
...                            optimizer=embank.optim.SGD(lr=0.1))
>>> bag = embank.torch.EmbeddingBag(items, mode="sum")
>>> sparse = embank.torch.SparseOptimizer([bag])
>>> out = bag(torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2]))   # bags [1, 2] and [2, 3]
>>> out.sum().backward()
>>> sparse.step()                      # one push_grad per table; returns the keys pushed
3
>>> [round(x, 4) for x in items.pull([1, 2]).ravel().tolist()]   # key 2 was in both bags
[0.0, 0.0, 0.0, 0.0, -0.1, -0.1, -0.1, -0.1]
>>> store.close()

How gradients reach the store (``push=``):

- ``"step"`` (default): backward gathers each lookup's ``(unique keys, gradients)``;
  :meth:`SparseOptimizer.step` pushes, per table, everything gathered since the last
  step in **one** ``push_grad`` (duplicate keys summed by the store). A table looked up
  several times in one step (a two-tower model's item table for positives and
  negatives) gets one optimizer update with the gradients of every lookup summed —
  what ``torch.nn.Embedding(sparse=True)`` with a sparse optimizer does.
- ``"backward"``: the gradient is pushed from backward itself (no ``step()`` call for
  the table). Only right when each table is looked up once per step.

A module may wrap a :class:`~embank.Table` or a :class:`~embank.Worker` (bounded
staleness: its pulls hold keys until their gradients are pushed), or for inference an
:class:`embank.gpu.GpuCache` (eval mode: rows answered from the cache's device, misses
fetched from its table). torch is an optional dependency, imported when this module is.

Training on a GPU: a module's outputs go to its device (moved with the model by
``model.to("cuda")``; ids given on a device send them there too). The rows stay on the
host, where they are pulled, pooled and updated; only this crosses PCIe:

- ``EmbeddingBagCollection`` (fused): every feature's pooled rows up in one copy a
  forward, their gradient down in one copy a backward;
- ``EmbeddingBag``: pools on the host; its pooled rows up, their gradient down;
- ``Embedding`` (nothing to pool): the unique rows and the inverse index up, the
  unique rows' gradient down.

An upload is copied into pinned memory (torch's caching host allocator: blocks reused
across calls, none handed out again before its copy has finished), then to the device
(``non_blocking``) on a copy stream, one a device; the caller's stream waits for the
copy's event and the host does not wait. A download is copied into pinned memory on the
caller's stream, after the kernels that made the gradient, and the host waits for that
copy's event: the one host wait of a module's backward (one for a whole fused
collection). Ids, offsets or ``per_sample_weights`` given on a device add a host wait
each (they are read on the host): give them from the data loader, on the host.

The next batch's pull overlaps this batch's work: :meth:`EmbeddingBagCollection.prefetch`
(per-table modules: :func:`lookahead`) reads batch *i+1*'s rows into the store's row
cache (the disk or network part of a pull) while batch *i* trains; their values are
read by *i+1*'s forward, after step *i*'s push, so a run equals the CPU's exactly, and
that forward's pull and pooling run on the host while the device finishes step *i*'s
dense optimizer (whose launches return at once).
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as e:  # the package installs without PyTorch
    raise ImportError("embank.torch needs PyTorch: pip install 'embank[torch]' (or torch itself)") from e

# What each module holds: _embedding (Embedding, EmbeddingBag: one table), _collection
# (the collections: many features, one native call a step each way), _sparse
# (SparseOptimizer), _lookahead (reading the next batch ahead), _state (checkpoints and
# TorchRec-layout state dicts), _torchrec (TorchRec's configs, optimizer specs and
# tensor types); under them _jagged (the input), _device (host-device copies) and
# _gradients (what a step pushes).
from ._collection import EmbeddingBagCollection, EmbeddingCollection
from ._embedding import Embedding, EmbeddingBag
from ._lookahead import lookahead
from ._sparse import SparseOptimizer
from ._state import checkpoint, export_state_dict, load_state_dict, optimizer_state_dict, state_dict_chunks
from ._torchrec import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    JaggedTensor,
    KeyedTensor,
    PoolingType,
    optimizer_from_spec,
)

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "EmbeddingCollection",
    "EmbeddingConfig",
    "JaggedTensor",
    "KeyedTensor",
    "PoolingType",
    "SparseOptimizer",
    "checkpoint",
    "export_state_dict",
    "load_state_dict",
    "lookahead",
    "optimizer_from_spec",
    "optimizer_state_dict",
    "state_dict_chunks",
]
