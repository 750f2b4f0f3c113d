"""Fixtures of the tools' tests."""

from __future__ import annotations

import pytest

from tests.conftest import require_tool
from tools import h2load


@pytest.fixture
def h2load_installed() -> str:
    """h2load's path: the capacity and served benches' client (skipped, or failed under `make test`, without it)."""
    return require_tool(h2load.EXECUTABLE, "apt-get install nghttp2-client (make setup does, as root)")
