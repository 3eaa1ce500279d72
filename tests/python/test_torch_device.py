"""Training a model on a device through the embank modules: the device code path (pooled
rows up through pinned memory on a copy stream, their gradients down) gives exactly the
CPU path's outputs and rows, step by step, with the next batch's rows read ahead.

On the CPU the CUDA code is driven with torch.cuda's streams and events stood in by
fakes that log every record, wait and host wait: copies complete at once, and the log
shows each upload waited on by the compute stream and each download waited on by the
host. With CUDA the same runs go through the real device."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import embank
import numpy as np
import pytest

torch = pytest.importorskip("torch")
et = pytest.importorskip("embank.torch")

pytestmark = pytest.mark.torch

N, DIM, STEPS, BAGS = 60, 4, 4, 6

# A case: builds (module, forward(batch) -> outputs, tables, read_ahead(batches) -> batches).
Case = Callable[
    [embank.Store, str],
    tuple[Any, Callable[[Any], list[Any]], list[embank.Table], Callable[[Iterable[Any]], Iterator[Any]]],
]


def _tables(store: embank.Store, prefix: str) -> list[embank.Table]:
    return [
        store.create_table(
            f"{prefix}{j}",
            dim=DIM,
            init=embank.init.uniform(-0.5, 0.5),
            seed=j,
            optimizer=embank.optim.Adagrad(lr=0.3, eps=1e-10),
        )
        for j in range(2)
    ]


def _collection(store: embank.Store, prefix: str) -> Any:
    """The fused collection: three weighted-sum features, two of them on one table."""
    t = _tables(store, prefix)
    ebc = et.EmbeddingBagCollection({"a": t[0], "b": t[1], "c": t[0]}, "sum")
    assert ebc.fused

    def forward(batch: Any) -> list[Any]:
        out = ebc(batch)
        return [out[n] for n in ("a", "b", "c")]

    return ebc, forward, t, lambda batches: ebc.prefetch(batches, lambda b: b)


def _per_table(store: embank.Store, prefix: str) -> Any:
    """A mean EmbeddingBag and an Embedding over 2-D ids."""
    t = _tables(store, prefix)
    model = torch.nn.ModuleDict({"bag": et.EmbeddingBag(t[0], "mean"), "emb": et.Embedding(t[1])})

    def forward(batch: Any) -> list[Any]:
        ids, offsets, grid = batch
        return [model["bag"](ids, offsets), model["emb"](grid)]

    def read_ahead(batches: Iterable[Any]) -> Iterator[Any]:
        ahead: Iterator[Any] = et.lookahead(batches, lambda b: {t[0]: b[0], t[1]: b[2].reshape(-1)})
        return ahead

    return model, forward, t, read_ahead


def _batches(case: str, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)

    def bags(weighted: bool) -> tuple[Any, ...]:
        sizes = rng.integers(0, 5, size=BAGS)
        ids = torch.from_numpy(rng.integers(0, N, size=int(sizes.sum())))
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))
        if not weighted:
            return ids, offsets
        return ids, offsets, torch.from_numpy(rng.uniform(0.5, 2.0, size=len(ids)).astype(np.float32))

    if case == "collection":
        return [{n: bags(weighted=True) for n in ("a", "b", "c")} for _ in range(STEPS)]
    return [
        (*bags(weighted=False), torch.from_numpy(rng.integers(0, N, size=(BAGS, 3)))) for _ in range(STEPS)
    ]


def _loss(outputs: list[Any]) -> Any:
    total = 0
    for o in outputs:
        # Made on the host: the device's linspace may round differently.
        w = torch.linspace(-1.0, 1.0, o.numel()).reshape(o.shape).to(o.device)
        total = total + (o * w).sum() + 0.5 * (o * o).sum()
    return total


def _train(
    case: Case, store: embank.Store, prefix: str, batches: list[Any], device: str, read_ahead: bool
) -> tuple[list[list[Any]], list[Any]]:
    """Trains STEPS steps; returns every step's outputs and the tables' rows after it."""
    module, forward, tables, ahead = case(store, prefix)
    module.to(device)
    sparse = et.SparseOptimizer(module)
    outputs, rows = [], []
    for batch in ahead(batches) if read_ahead else batches:
        out = forward(batch)
        assert all(o.device.type == torch.device(device).type for o in out), [o.device for o in out]
        _loss(out).backward()
        sparse.step()
        outputs.append([o.detach().cpu().numpy() for o in out])
        keys = np.arange(N, dtype=np.uint64)
        rows.append(np.stack([t.lookup(keys)[0] for t in tables]))
    return outputs, rows


def _assert_same(
    seen: tuple[list[list[Any]], list[Any]], expected: tuple[list[list[Any]], list[Any]], exact: bool
) -> None:
    def close(seen: Any, expected: Any, err_msg: str) -> None:
        np.testing.assert_allclose(seen, expected, rtol=1e-5, atol=1e-6, err_msg=err_msg)

    same = np.testing.assert_array_equal if exact else close
    assert len(seen[0]) == len(expected[0]) == STEPS, (len(seen[0]), len(expected[0]))
    for step, (outs, outs_cpu) in enumerate(zip(seen[0], expected[0])):
        for j, (o, o_cpu) in enumerate(zip(outs, outs_cpu)):
            same(o, o_cpu, err_msg=f"step {step}, output {j}: the device path's differs from the CPU's")
    for step, (r, r_cpu) in enumerate(zip(seen[1], expected[1])):
        same(r, r_cpu, err_msg=f"step {step}: rows after the device path's step differ from the CPU's")


class _FakeCuda:
    """torch.cuda's streams and events on the CPU: every record, wait and host wait logged."""

    def __init__(self) -> None:
        log: list[tuple[str, str, int]] = []
        ids = itertools.count(1)

        class Stream:
            def __init__(self, device: Any = None, name: str = "copy") -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                log.append(("wait", self.name, event.id))

        class Event:
            def __init__(self) -> None:
                self.id = next(ids)

            def record(self, stream: Any) -> None:
                log.append(("record", stream.name, self.id))

            def synchronize(self) -> None:
                log.append(("sync", "host", self.id))

        self.log, self.Stream, self.Event = log, Stream, Event
        self.current: Any = Stream(name="compute")

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def transfers(self) -> tuple[int, int]:
        """(uploads, downloads) in the log, each checked: an upload's event recorded on
        the copy stream and then waited on by the compute stream; a download's recorded on
        the compute stream and then waited on by the host."""
        ups = downs = 0
        for i in range(0, len(self.log), 2):
            (kind, stream, event), nxt = self.log[i], self.log[i + 1 : i + 2]
            if (kind, stream) == ("record", "copy"):
                assert nxt == [("wait", "compute", event)], f"entry {i} of {self.log}: no wait on the upload"
                ups += 1
            else:
                assert (kind, stream) == ("record", "compute"), f"entry {i} of {self.log}"
                assert nxt == [("sync", "host", event)], (
                    f"entry {i} of {self.log}: no host wait on the download"
                )
                downs += 1
        return ups, downs


@pytest.mark.parametrize(
    ("name", "case", "per_step"), [("collection", _collection, (1, 1)), ("per_table", _per_table, (3, 2))]
)
def test_the_device_path_on_the_cpu_equals_the_cpu_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, case: Case, per_step: tuple[int, int]
) -> None:
    """``per_step``: uploads and downloads a step (the collection: every feature's pooled
    rows in one; the bag: its pooled rows; the Embedding: unique rows and inverse up)."""
    store = embank.open(tmp_path / "store")
    batches = _batches(name, seed=7)
    expected = _train(case, store, "cpu", batches, "cpu", read_ahead=False)

    fake = _FakeCuda()
    for attr in ("Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, attr, getattr(fake, attr))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    import embank._device as host_device

    transfer = host_device._Transfer(torch.device("cpu"))
    assert not transfer.pinned
    # The CPU takes the CUDA path.
    monkeypatch.setattr(host_device, "_transfer_for", lambda device: transfer)
    seen = _train(case, store, "device", batches, "cpu", read_ahead=True)
    monkeypatch.undo()

    _assert_same(seen, expected, exact=True)
    ups, downs = fake.transfers()
    assert (ups, downs) == (per_step[0] * STEPS, per_step[1] * STEPS), (ups, downs, fake.log)
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "case"), [("collection", _collection), ("per_table", _per_table)])
def test_on_cuda_training_equals_the_cpu_path(tmp_path: Path, name: str, case: Case) -> None:
    """The module moved to CUDA with ``.to``, ids on the host: outputs on the device. Pooled
    on the host, so bags equal the CPU's bit for bit; the Embedding's gradient is summed on
    the device (in another order)."""
    store = embank.open(tmp_path / "store")
    batches = _batches(name, seed=7)
    expected = _train(case, store, "cpu", batches, "cpu", read_ahead=False)
    seen = _train(case, store, "cuda", batches, "cuda", read_ahead=True)
    _assert_same(seen, expected, exact=name == "collection")
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_forward_from_host_ids_never_waits_for_the_device(tmp_path: Path) -> None:
    store = embank.open(tmp_path / "store")
    ebc, forward, _, _ = _collection(store, "s")
    ebc.to("cuda")
    batch = _batches("collection", seed=3)[0]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _loss(out).backward()  # the download waits: the one host wait of the step
    store.close()


def test_outputs_go_where_the_module_was_moved(tmp_path: Path) -> None:
    """``module.to(device)`` sends every module's outputs there (the meta device stands in
    for a GPU: a plain copy), ids on the host; moved back, they come back."""
    store = embank.open(tmp_path / "store")
    t = _tables(store, "m")
    ids, offsets = torch.tensor([1, 2, 2, 3]), torch.tensor([0, 2])
    modules: list[tuple[Any, Callable[[Any], Any]]] = [
        (et.Embedding(t[0]), lambda m: m(ids)),
        (et.EmbeddingBag(t[0]), lambda m: m(ids, offsets)),
        (
            et.EmbeddingBagCollection({"a": t[0], "b": t[1]}),
            lambda m: m({"a": (ids, offsets), "b": (ids, offsets)})["b"],
        ),
        (et.EmbeddingBagCollection({"a": t[0]}, fused=False), lambda m: m({"a": (ids, offsets)})["a"]),
    ]
    for module, forward in modules:
        module.eval()
        assert "_where" not in module.state_dict()
        assert forward(module.to("meta")).device.type == "meta", module
        assert forward(module.to_empty(device="cpu")).device.type == "cpu", module
    store.close()
