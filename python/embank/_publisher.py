"""A store's update-stream publisher (made by :meth:`embank.Store.publisher`)."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

from . import _native
from .errors import EmbankError, PublishError


class Publisher:
    """Sends a store's checkpoints to an update stream; made by :meth:`Store.publisher`.

    A context manager: leaving the block waits until the newest checkpoint is
    published (:meth:`flush`), then stops the publisher."""

    def __init__(self, native: _native.Publisher, every: int) -> None:
        self._p = native
        self._every = every
        self._seen = 0
        self.closed = False

    def _checkpointed(self) -> None:
        self._seen += 1
        if self._seen % self._every:
            return
        try:
            self._p.notify()
        except EmbankError as e:
            raise PublishError(str(e)) from e

    def flush(self, timeout: float = 60.0) -> None:
        """Publishes up to the newest checkpoint and waits for the broker's
        acknowledgement; raises ``EmbankTimeoutError`` (with the broker's last error)
        after ``timeout`` seconds."""
        self._p.flush(float(timeout))

    def status(self) -> dict[str, Any]:
        """``published_batch_id``, ``published_seq``, ``pending``, counts of messages,
        rows, deletes and bytes sent, ``full_snapshots``, ``retention_snapshots``,
        ``trims`` and ``messages_trimmed`` (see ``keep_checkpoints``), ``trimmed_to_seq``,
        ``last_error``, ..."""
        out: dict[str, Any] = json.loads(self._p.status_json())
        return out

    def close(self) -> None:
        """Stops the publisher (without waiting for what is pending). Idempotent."""
        if not self.closed:
            self.closed = True
            self._p.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                self.flush()
        finally:
            self.close()
