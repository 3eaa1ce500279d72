"""Opening a store: :func:`open` (a directory) and :func:`connect` (``embank serve``
shards). Each hands its options to the native layer as one JSON object."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _native
from ._store import Store
from ._table import KeysLike, _keys
from .errors import ConfigError, InvalidInputError

__all__ = ["connect", "open", "shard_of"]


def open(
    path: str | os.PathLike[str],
    *,
    create: bool = True,
    verify: bool = False,
    cache_bytes: int = 256 << 20,
    io_engine: str = "auto",
    io_depth: int = 128,
    mmap_random_access: bool = True,
    huge_pages: bool = False,
    row_writes: str = "mapped",
    keep_checkpoints: int = 2,
    background_repair: bool = True,
    pooled_cache_bytes: int = 0,
    hot_placement: dict[str, Any] | None = None,
    shared_tier: dict[str, Any] | None = None,
) -> Store:
    """Opens (or creates) the store in directory ``path``.

    Serves at once: tables closed cleanly are mapped, not read. Tables whose
    process was killed serve at once too: index buckets are repaired when first
    touched and a background thread finishes the repair (see
    :meth:`Store.wait_repaired`); after a machine crash, one pass over each index
    repairs it before ``open`` returns.

    Args:
        create: create the store if ``path`` holds none (else raise ``NotFoundError``).
        verify: check every row's checksum on open (after a power loss).
        cache_bytes: budget of the DRAM row cache shared by the store's tables
            (0 for none); taken as rows are cached, not up front.
        io_engine: ``"auto"`` (io_uring where the kernel allows, else pread),
            ``"uring"`` or ``"pread"``: how block-medium tables are read.
        io_depth: most block-medium reads in flight per batch.
        mmap_random_access: map mmap-medium files with ``MADV_RANDOM`` (the default):
            no read-around, small page-cache folios, so a row write dirties one page.
            Turn off for read-only tables that fit in memory (reads ~25 % faster).
        huge_pages: map the index and mmap-medium rows with transparent huge pages
            (``MADV_HUGEPAGE``, where the kernel and file system allow): fewer TLB misses
            on random reads; a row write dirties a whole 2 MiB page, so for read-mostly
            stores such as serving replicas. Default off.
        row_writes: how rows reach an mmap table's file: ``"mapped"`` (the default:
            copied into the mapping, cheapest for writers) or ``"file"`` (``pwrite``): the
            kernel's write-back of the rows then sends no TLB shootdown to the cores that
            read, at about 2.5 us more per scattered row written. For a store read by
            many cores while it ingests updates.
        keep_checkpoints: how many :meth:`Store.checkpoint` s are kept for :meth:`Store.restore`.
        background_repair: after a killed process, repair in the background (the
            default); ``False`` repairs everything before ``open`` returns.
        pooled_cache_bytes: budget of the pooled-embedding cache (0, the default: none).
            For inference: :meth:`Table.lookup_pooled` (and ``embank.torch``'s bags in
            eval mode) answer a bag whose whole id sequence was pooled before from it,
            skipping the lookup and pooling; a write to any member row drops the bag.
        hot_placement: automatic hot placement (off by default): tables sample the keys
            their reads ask for, and now and then each table's hot set is moved into its
            home index buckets (one bucket read per lookup; see :meth:`Table.place_hot`).
            A dict of ``keys`` (hot-set size, 10000), ``every_seconds`` (600),
            ``sample_every`` (16) and ``min_home_fraction`` (0.99); ``{}`` takes them all.
        shared_tier: a Redis Cluster shared with other serving stores, between the row
            cache and the medium of cached tables (HPS's level 2): a dict of
            ``redis_cluster`` (``["host:port", ...]``), ``ttl_seconds`` (None),
            ``timeout_ms`` (250) and ``backoff_ms`` (1000), as ``embank serve``'s
            ``[shared_tier]``. Misses of the row cache are fetched from the cluster,
            the cluster's misses from the medium and stored there in the background;
            a node down is counted (``stats()["shared_tier"]``), never an error.

    Raises:
        StoreLockedError: another process or handle has the store open.
        FormatVersionError: the store was written by an unknown format version.
    """
    if cache_bytes < 0 or io_depth < 1 or pooled_cache_bytes < 0:
        raise ConfigError("cache_bytes and pooled_cache_bytes must be >= 0, io_depth >= 1")
    options: dict[str, Any] = {
        "create": bool(create),
        "verify": bool(verify),
        "cache_bytes": int(cache_bytes),
        "io_engine": io_engine,
        "io_depth": int(io_depth),
        "mmap_random_access": bool(mmap_random_access),
        "huge_pages": bool(huge_pages),
        "row_writes": row_writes,
        "keep_checkpoints": int(keep_checkpoints),
        "background_repair": bool(background_repair),
        "pooled_cache_bytes": int(pooled_cache_bytes),
        "hot_placement": hot_placement,
        "shared_tier": shared_tier,
    }
    return Store(_native.Store.open(os.fspath(path), json.dumps(options)))


def _is_map_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def _is_map(addrs: str) -> bool:
    """Whether ``connect``'s ``addrs`` string names a cluster file (the shard map) rather
    than addresses: an ``http://`` URL, or the path of an existing file or of one ending
    in ``.toml`` (its absence is then reported as such)."""
    return _is_map_url(addrs) or addrs.endswith(".toml") or os.path.isfile(addrs)


def _from_config(source: str) -> tuple[list[list[str]], dict[str, Any]]:
    """Shards and settings of a cluster file, or of the ``http://`` URL serving one (see
    :func:`connect`)."""
    c: dict[str, Any] = json.loads(_native.client_config_json(source))
    groups = [[str(a) for a in s["replicas"]] for s in c.pop("shards")]
    c.pop("token_file", None)
    # The shard map: the client reloads it while it runs.
    c["map"] = source if _is_map_url(source) else os.path.abspath(source)
    return groups, {k: v for k, v in c.items() if v is not None}


def shard_of(keys: KeysLike, shards: int) -> npt.NDArray[np.uint32]:
    """The shard (0 to ``shards - 1``) each key goes to among ``shards`` shards, as
    :func:`connect` routes keys: a jump consistent hash of the key's xxh3, the same in
    every client and in ``embank reshard``. Growing from n to n + 1 shards moves a key
    only onto the new shard. Returns a uint32 array (``shard_of([3, 14, 15, 92], 2)`` is
    ``[1, 0, 0, 0]``); the GIL is released for large arrays.
    """
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)):
        raise TypeError(f"shards must be an int, got {type(shards).__name__}")
    if not 1 <= shards <= 0xFFFF_FFFF:
        raise InvalidInputError(f"shards must be between 1 and 2**32 - 1, got {shards}")
    return _native.shard_of(_keys(keys), int(shards))


def connect(
    addrs: str | os.PathLike[str] | Sequence[str | Sequence[str]],
    *,
    token: str | None = None,
    timeout: float | None = None,
    connect_timeout: float | None = None,
    keys_per_request_max: int | None = None,
    in_flight_per_shard: int | None = None,
    tls_ca_file: str | os.PathLike[str] | None = None,
    tls_cert_file: str | os.PathLike[str] | None = None,
    tls_key_file: str | os.PathLike[str] | None = None,
    tls_server_name: str | None = None,
    min_checkpoint: int | None = None,
    deadline_min: float | None = None,
    deadline_alone_min: float | None = None,
    hedge_delay: float | None = None,
) -> Store:
    """Connects to a networked store: the ``embank serve`` processes at ``addrs``
    (``"host:port"`` each; one shard per address, in the same order in every client),
    or those a cluster file lists (see below).

    A shard may have several replicas: give it as a list of addresses (or
    ``"a:7070|b:7070"``), its primary first. Reads (``lookup``, and ``pull`` on
    read-only replicas fed by an update stream) are spread over the healthy replicas
    and fail over to another within the call on an error or timeout; writes go to the
    primary alone; errors name the shard and replica.

    Returns a :class:`Store` whose tables have the same methods and errors as those of
    :func:`open`. Keys go to shards by a consistent hash; a batch is split into requests
    of at most ``keys_per_request_max`` keys, sent in parallel and put back in order.

    Args:
        token: the servers' shared secret (required when they listen beyond loopback).
        timeout: seconds to wait for a reply before raising ``EmbankTimeoutError``
            (default 30).
        connect_timeout: seconds to wait for a connection (default 5).
        keys_per_request_max: keys per request (default 500; the servers' own limit is
            higher).
        in_flight_per_shard: most requests of one call in flight to one shard (default 8).
        tls_ca_file: connect over TLS, verifying each server against these CA
            certificates (PEM; ``embank cert`` writes a development CA).
        tls_cert_file, tls_key_file: this client's certificate and key (PEM), for
            servers that require one (``client_ca_file`` in their ``[tls]``).
        tls_server_name: the name the servers' certificates must carry (default: the
            host part of each address).
        min_checkpoint: reads only from replicas serving the training checkpoint of
            this batch id or later (see :meth:`Store.served`); per call with
            ``table.lookup(keys, min_checkpoint=...)``.
        deadline_min: seconds, the shortest deadline of a read a sibling replica could
            take over (default 0.1). Each keyed request may take 10x its replica's recent
            p99, at least this, at most ``timeout``; a replica that misses it is ejected
            from the rotation (a background probe readmits it once it answers in time and
            is current) and the read goes to a sibling.
        deadline_alone_min: seconds, the shortest deadline of a request no other replica
            can take (a write, a read of a single server; default 5): missing it raises
            ``EmbankTimeoutError`` naming the shard and the wait.
        hedge_delay: seconds a read waits before a copy goes to a sibling replica serving
            a checkpoint at least as new (the first answer is taken); default the group's
            recent p95 (at least 1 ms); 0: no hedged reads. ``store.replica_counts()``
            counts hedges, deadlines missed, ejections and readmissions per replica.

    ``addrs`` may instead be a cluster file: a path (a path object, a string ending in
    ``.toml``, or the path of an existing file) or an ``http://`` URL serving one. The
    cluster file is the **shard map**: the shards as ``[[shards]] replicas = ["a:7070",
    "b:7070"]`` (or ``service = "name:7070"``, a DNS name resolving to the replicas),
    ``version`` and ``reload_seconds``, and any of ``token`` (or ``token_file``),
    ``tls_ca_file``, ``tls_cert_file``, ``tls_key_file``, ``tls_server_name``,
    ``timeout_seconds``, ``connect_timeout_seconds``, ``keys_per_request_max``,
    ``in_flight_per_shard``, ``min_checkpoint``, ``deadline_min_seconds``,
    ``deadline_alone_min_seconds``, ``hedge_delay_seconds``; keyword arguments given here win over
    the file. The store reloads the map every ``reload_seconds`` (default 2) while it is
    open and switches to a higher ``version`` between calls (no call mixes two maps);
    ``embank map switch`` writes the next version. Relative paths in a file are taken
    from the file's directory, in a map read from a URL from the current directory.

    The TLS files default to the environment variables ``EMBANK_TLS_CA_FILE``,
    ``EMBANK_TLS_CERT_FILE`` and ``EMBANK_TLS_KEY_FILE`` when not given.

    Raises:
        ShardUnavailableError: a shard cannot be reached (the message names it).
        UnauthorizedError: a shard refused the token.
    """

    def path(p: str | os.PathLike[str] | None) -> str | None:
        return None if p is None else os.fspath(p)

    given: dict[str, Any] = {
        "token": token,
        "timeout_seconds": None if timeout is None else float(timeout),
        "connect_timeout_seconds": None if connect_timeout is None else float(connect_timeout),
        "keys_per_request_max": None if keys_per_request_max is None else int(keys_per_request_max),
        "in_flight_per_shard": None if in_flight_per_shard is None else int(in_flight_per_shard),
        "tls_ca_file": path(tls_ca_file),
        "tls_cert_file": path(tls_cert_file),
        "tls_key_file": path(tls_key_file),
        "tls_server_name": tls_server_name,
        "min_checkpoint": None if min_checkpoint is None else int(min_checkpoint),
        "deadline_min_seconds": None if deadline_min is None else float(deadline_min),
        "deadline_alone_min_seconds": None if deadline_alone_min is None else float(deadline_alone_min),
        "hedge_delay_seconds": None if hedge_delay is None else float(hedge_delay),
    }
    # What is given here wins over the file, the file over the environment.
    options = {k: v for k, v in given.items() if v is not None}
    listed: Sequence[str | Sequence[str]]
    if isinstance(addrs, os.PathLike) or (isinstance(addrs, str) and _is_map(addrs)):
        listed, conf = _from_config(os.fspath(addrs))
        options = {**conf, **options}
    elif isinstance(addrs, str):
        listed = [a for a in addrs.removeprefix("tcp://").split(",") if a]
    else:
        listed = addrs
    groups: list[list[str]] = []
    for a in listed:
        group = [x for x in a.split("|") if x] if isinstance(a, str) else [str(x) for x in a]
        if not group:
            raise ConfigError("connect: a shard with no address")
        groups.append(group)
    if not groups:
        raise ConfigError("connect: give at least one shard address")
    for key, var in (
        ("tls_ca_file", "EMBANK_TLS_CA_FILE"),
        ("tls_cert_file", "EMBANK_TLS_CERT_FILE"),
        ("tls_key_file", "EMBANK_TLS_KEY_FILE"),
    ):
        if key not in options and var in os.environ:
            options[key] = os.environ[var]
    return Store(_native.Store.connect(groups, json.dumps(options)))
