"""The test suite's port picker: a port it hands out is not handed out again before its process binds it."""

from __future__ import annotations

import pytest

from tests.support.servers import free_port

pytestmark = pytest.mark.unit


def test_successive_ports_are_distinct():
    # 200 random draws from ~12,000 ports would repeat one about 4 times in 5 (the birthday bound).
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
