import pytest

from gpuwise.hardware.catalog import load_catalog


@pytest.fixture(scope="session")
def catalog():
    return load_catalog()


@pytest.fixture(autouse=True)
def _no_user_catalog(monkeypatch):
    # A developer's own GPUWISE_CATALOG must not change what the tests see.
    monkeypatch.delenv("GPUWISE_CATALOG", raising=False)
