"""Fixtures shared by the whole suite; the helpers themselves live in tests/helpers.py."""

from __future__ import annotations

import pytest

from tests.helpers import LAYOUTS


@pytest.fixture(params=sorted(LAYOUTS))
def layout_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)
