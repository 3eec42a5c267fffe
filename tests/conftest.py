import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    """Built-in models materialize into one cache per test session, never into ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "gpufleet-cache"
    monkeypatch.setenv("GPUFLEET_CACHE", str(cache))
    for name in list(os.environ):
        if name.startswith("GPUFLEET_") and "__" in name:
            monkeypatch.delenv(name)
