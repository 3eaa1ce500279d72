"""Exceptions raised by embank.

Every error derives from :class:`EmbankError` and, where one fits, from the
built-in exception a Python user would expect (``ValueError`` for bad input,
``KeyError`` for an unknown table, ``OSError`` for I/O and locking, ...), so
existing ``except`` clauses keep working.
"""

from __future__ import annotations


class EmbankError(Exception):
    """Base class of every embank error."""


class InvalidInputError(EmbankError, ValueError):
    """A call's input is wrong: dim, shape, contiguity, negative keys, bad name."""


class ConfigError(EmbankError, ValueError):
    """Options that cannot work: dim out of range, bad initializer, ..."""


class NotFoundError(EmbankError, KeyError):
    """A table (or store) does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


TableNotFoundError = NotFoundError


class TableExistsError(EmbankError, ValueError):
    """A table of that name exists already."""


class TableFullError(EmbankError):
    """The table has no room and growth is turned off."""


class StoreLockedError(EmbankError, OSError):
    """Another process (or another handle in this one) has the store open."""


class FormatVersionError(EmbankError):
    """The store was written by a format version this build cannot read."""


class CorruptStoreError(EmbankError):
    """Stored data failed a checksum or a consistency check."""


class StoreClosedError(EmbankError, ValueError):
    """The store (or the table's store) is closed."""


class EmbankIOError(EmbankError, OSError):
    """The operating system refused an operation."""


class EmbankTimeoutError(EmbankError, TimeoutError):
    """A wait ran out of time."""


class UnsupportedError(EmbankError, NotImplementedError):
    """Not supported by this build or medium."""


class UnauthorizedError(EmbankError, PermissionError):
    """A server refused the connection's token (``embank.connect(..., token=...)``)."""


class ShardUnavailableError(EmbankError, ConnectionError):
    """A server (shard) of a remote store cannot be reached; the message names it."""


class PublishError(EmbankError, ConnectionError):
    """Checkpoints cannot reach the update stream: more than ``checkpoints_pending_max`` wait for
    the broker. The checkpoint itself was taken; the stream gets a full snapshot once
    the broker is back (see :meth:`embank.Store.publisher`).

    Raised by :meth:`embank.Store.checkpoint` after every publisher was told of the
    checkpoint; ``errors`` holds one error per failing publisher (the message names
    each stream)."""

    def __init__(self, *args: object, errors: list[PublishError] | None = None) -> None:
        super().__init__(*args)
        #: One error per failing publisher (this error alone when raised by one).
        self.errors: list[PublishError] = errors if errors is not None else [self]

    @classmethod
    def of(cls, errors: list[PublishError], *, publishers: int, batch_id: int) -> PublishError:
        """One error for the publishers that failed at checkpoint ``batch_id``."""
        if len(errors) == 1 and publishers == 1:
            return errors[0]
        lines = "\n".join(f"  {i + 1}. {e}" for i, e in enumerate(errors))
        one = cls(
            f"{len(errors)} of {publishers} publishers failed at checkpoint {batch_id} "
            f"(every publisher was told of it):\n{lines}",
            errors=errors,
        )
        one.__cause__ = errors[0]
        return one


__all__ = [
    "ConfigError",
    "CorruptStoreError",
    "EmbankError",
    "EmbankIOError",
    "EmbankTimeoutError",
    "FormatVersionError",
    "InvalidInputError",
    "NotFoundError",
    "PublishError",
    "ShardUnavailableError",
    "StoreClosedError",
    "StoreLockedError",
    "TableExistsError",
    "TableFullError",
    "TableNotFoundError",
    "UnauthorizedError",
    "UnsupportedError",
]
