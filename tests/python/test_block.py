"""The block medium and the DRAM row cache from Python."""

from __future__ import annotations

import time
from pathlib import Path

import embank
import numpy as np
import pytest
from embank.errors import ConfigError


def test_block_table_round_trip_with_a_small_cache(store_path: Path) -> None:
    rng = np.random.default_rng(3)
    keys = np.arange(5_000, dtype=np.uint64)
    rows = rng.standard_normal((len(keys), 32)).astype(np.float32)
    with embank.open(store_path, cache_bytes=64 << 10, io_engine="auto") as s:
        t = s.create_table("items", 32, medium="block")
        t.push(keys, rows)
        np.testing.assert_array_equal(t.pull(keys[::7]), rows[::7])
        t.push(keys[:100], rows[:100] + 1)
        st = t.stats()
        assert st["medium"] == "block"
        assert st["placement"] == "cache"
        assert st["io"]["engine"] in ("uring", "pread")
        assert st["cache_misses"] > 0
        assert s.stats()["cache"]["evictions"] > 0, "64 KiB cannot hold 5,000 rows"
    with embank.open(store_path) as s:
        t = s.table("items")
        np.testing.assert_array_equal(t.pull(keys[:100]), rows[:100] + 1)
        np.testing.assert_array_equal(t.pull(keys[100:]), rows[100:])
        assert len(t) == len(keys)


def test_lookahead_loads_rows_into_the_cache(store_path: Path) -> None:
    keys = np.arange(2_000, dtype=np.uint64)
    with embank.open(store_path) as s:
        t = s.create_table("t", 16, medium="block")
        t.push(keys, np.ones((len(keys), 16), np.float32))
    with embank.open(store_path) as s:
        t = s.table("t")
        assert t.lookahead(keys[:1_000]) is True
        deadline = time.monotonic() + 10
        while t.stats()["lookahead_rows"] < 1_000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.stats()["lookahead_rows"] == 1_000
        t.pull(keys[:1_000])
        st = t.stats()
        assert st["cache_hits"] == 1_000 and st["cache_misses"] == 0


@pytest.mark.parametrize("placement", ["pin", "bypass"])
def test_placements(store_path: Path, placement: str) -> None:
    keys = np.arange(300, dtype=np.uint64)
    rows = np.arange(300 * 8, dtype=np.float32).reshape(300, 8)
    with embank.open(store_path) as s:
        s.create_table("t", 8, medium="block", placement=placement).push(keys, rows)
    with embank.open(store_path) as s:
        t = s.table("t")
        np.testing.assert_array_equal(t.pull(keys), rows)
        st = t.stats()
        assert st["placement"] == placement
        if placement == "pin":
            assert st["cache_hits"] == 300, "a pinned table is loaded at open"
            assert s.stats()["cache"]["pinned_bytes"] > 0
        else:
            assert st["cache_hit_rate"] is None


def test_bad_media_options_are_config_errors(store_path: Path) -> None:
    with embank.open(store_path, cache_bytes=0) as s:
        with pytest.raises(ConfigError, match="unknown medium"):
            s.create_table("a", 4, medium="tape")
        with pytest.raises(ConfigError, match="unknown placement"):
            s.create_table("a", 4, placement="everywhere")
        with pytest.raises(ConfigError, match="cache_bytes > 0"):
            s.create_table("a", 4, medium="block", placement="cache")
        assert s.tables() == [], "nothing is left behind by a refused create"
        t = s.create_table("a", 4, medium="block")
        assert t.stats()["placement"] == "bypass"
    with pytest.raises(ConfigError, match="unknown I/O engine"):
        embank.open(store_path, io_engine="aio")
