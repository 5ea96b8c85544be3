import pytest


@pytest.fixture(autouse=True)
def _float64(float64_by_default):
    """Every smoothness test runs in float64 (tests/conftest.py)."""
