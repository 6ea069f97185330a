import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _shared_cache(tmp_path_factory):
    """One tokenizer/data cache for the whole session (subprocesses inherit it)."""
    os.environ["TITANLITE_CACHE"] = str(tmp_path_factory.mktemp("titanlite-cache"))
    yield
