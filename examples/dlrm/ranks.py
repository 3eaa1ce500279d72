"""The trainers of a ``torchrun`` job, for the DLRM example (one process: rank 0 of 1,
every collective a no-op).

Under ``torchrun`` (``WORLD_SIZE > 1``) :class:`Ranks` starts the process group (gloo on
the CPU), splits every global batch into contiguous rank shares, gathers evaluation
scores in the order one process would have them, and sums counts.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import embank.datasets as ds
import torch
from torch import nn


class Ranks:
    """This process's place among the trainers: ``rank`` of ``world``; ``restarted``
    when ``torchrun --max-restarts`` started it again after a rank failed."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.restarted = self.attempt > 0
        # The tests' kill: EMBANK_DLRM_KILL=RANK:BATCH (see kill_hook).
        hook = os.environ.get("EMBANK_DLRM_KILL")
        self.kill_at = tuple(map(int, hook.split(":"))) if hook and not self.restarted else None
        self.dist: Any = None
        if self.world > 1:
            self._init_process_group()

    def _init_process_group(self) -> None:
        import torch.distributed as dist

        faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints a stuck rank's stacks
        timeout = datetime.timedelta(minutes=5)
        # The process group's keys under a prefix of their own per torchrun restart: with
        # the agent's store shared by every attempt, a restarted rank could otherwise read
        # the address a killed rank published and fail to connect (seen with gloo).
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            self.world,
            is_master=self.rank == 0 and not agent,
            timeout=timeout,
        )
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=dist.PrefixStore(f"embank-dlrm/attempt-{self.attempt}", store),
            rank=self.rank,
            world_size=self.world,
            timeout=timeout,
        )
        self.dist = dist

    def barrier(self) -> None:
        if self.dist is not None:
            self.dist.barrier()

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (creating what the others then open), the other
        ranks after it."""
        if self.rank != 0:
            self.barrier()
        yield
        if self.rank == 0:
            self.barrier()

    def share(self, batches: Iterable[ds.Batch]) -> Iterator[ds.Batch]:
        """This rank's contiguous share of every global batch (a last batch too small to
        give every rank a row is left out)."""
        for b in batches:
            if self.world > 1:
                if len(b) < self.world:
                    continue
                lo, hi = len(b) * self.rank // self.world, len(b) * (self.rank + 1) // self.world
                b = ds.Batch(b.dense[lo:hi], b.sparse[lo:hi], b.labels[lo:hi])
            yield b

    def parallel(self, model: nn.Module) -> nn.Module:
        """The model to train: under ``DistributedDataParallel`` (the dense gradients
        averaged over the ranks) when there are several."""
        return nn.parallel.DistributedDataParallel(model) if self.world > 1 else model

    def gather(self, *parts: list[Any]) -> tuple[list[Any], ...]:
        """Per-batch lists (labels, scores, ...) of every rank, batch by batch and rank by
        rank: each batch's rows in their order."""
        if self.dist is None:
            return parts
        every: list[Any] = [None] * self.world
        self.dist.all_gather_object(every, parts)
        return tuple(
            [share for i in range(len(part)) for share in (r[k][i] for r in every)]
            for k, part in enumerate(parts)
        )

    def sum(self, n: int) -> int:
        if self.dist is None:
            return n
        total = torch.tensor([n], dtype=torch.int64)
        self.dist.all_reduce(total)
        return int(total.item())

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()

    def kill_hook(self, batch: int) -> None:
        """The tests' kill: ``EMBANK_DLRM_KILL=RANK:BATCH`` SIGKILLs that rank after that
        batch, in the first attempt only."""
        if self.kill_at == (self.rank, batch):
            print(f"rank {self.rank}: killed after batch {batch} (EMBANK_DLRM_KILL)", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
