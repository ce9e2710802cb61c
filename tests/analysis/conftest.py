"""The analysis tests' run: the tiny model's full-cache run with prefill states
(`tests.conftest.tiny_run`)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_run


@pytest.fixture(scope="module")
def run():
    return tiny_run()
