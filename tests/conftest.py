"""Shared pytest fixtures and settings.

Hub access is switched off: a test that tries the network fails instead of hanging.
"""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import logging  # noqa: E402

import pytest  # noqa: E402

import dipaco.data.sources  # noqa: E402
from _corpus_memo import memo_walk  # noqa: E402
# the hostile-input tests' two shared tiny runs, made once per session when asked for
from _hostile import finished, sigterm_stopped  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def _stdlib_corpus_walked_once():
    """The corpus loader's walk of the standard library, memoised for the session
    (tests/_corpus_memo.py says why that keeps every test's meaning)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dipaco.data.sources, "iter_python_sources", memo_walk(dipaco.data.sources.iter_python_sources))
        yield


@pytest.fixture(autouse=True)
def _dipaco_log_reaches_caplog():
    """The ``dipaco`` logger prints its own ``[dipaco]`` lines and stops there (so Hydra's
    root handler does not print them twice); ``caplog`` listens at the root, so during a
    test its records go on up as well."""
    log = logging.getLogger("dipaco")
    before, log.propagate = log.propagate, True
    yield
    log.propagate = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` when CUDA is absent (CPU-only CI)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA + nccl")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords hold every parent's name, so
        # a checkout in a directory called gpu would skip the whole suite
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
