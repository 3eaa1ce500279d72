from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import embank
import pytest


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_path: Path) -> Iterator[embank.Store]:
    s = embank.open(store_path)
    yield s
    s.close()
