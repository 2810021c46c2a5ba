"""Fixtures of the vLLM tests that build the connector in-process."""

from __future__ import annotations

import pytest


@pytest.fixture
def store_url(memory_url):
    """The connector's store: a memory store of this test's own, dropped after it."""
    return memory_url
