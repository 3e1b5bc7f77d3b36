import pytest

from gpuwise.hardware.catalog import load_catalog


@pytest.fixture(scope="session")
def catalog():
    return load_catalog()


@pytest.fixture(autouse=True)
def _no_user_catalog(monkeypatch):
    # A developer's own GPUWISE_CATALOG must not change what the tests see.
    monkeypatch.delenv("GPUWISE_CATALOG", raising=False)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_run_record(tmp_path, monkeypatch):
    # Every test writes its plans, benches and runs to its own record, never the user's.
    monkeypatch.setenv("GPUWISE_DB", str(tmp_path / "runs.sqlite"))


@pytest.fixture(autouse=True, scope="session")
def _session_model_cache(tmp_path_factory):
    # Converted bases (SmolLM2's GGUF -> safetensors, ~40 s) go to one cache for the whole session: converted
    # once, shared by every test, and never the user's own cache.
    import os

    before = os.environ.get("GPUWISE_CACHE")
    os.environ["GPUWISE_CACHE"] = str(tmp_path_factory.mktemp("model-cache"))
    yield
    if before is None:
        os.environ.pop("GPUWISE_CACHE", None)
    else:
        os.environ["GPUWISE_CACHE"] = before


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (started on first use; tests/record_servers.py). PGPASSFILE
    points at its password file, as a team's would: no URL in a test carries the password."""
    import os

    from record_servers import Postgres

    server = Postgres()
    before = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = server.passfile
    yield server
    if before is None:
        os.environ.pop("PGPASSFILE", None)
    else:
        os.environ["PGPASSFILE"] = before
    server.stop()
