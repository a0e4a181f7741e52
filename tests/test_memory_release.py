"""release_free_memory (dipaco/runtime/hardware.py): freed memory inside the C heap goes
back to the OS, not only the heap's top (what the rounds loop relies on after a round)."""
from __future__ import annotations

import os
import sys

import pytest

from dipaco.runtime.hardware import release_free_memory


def _rss_mib() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc: Linux only")
def test_holes_under_a_live_block_go_back_to_the_os() -> None:
    chunks = [bytearray(96 * 1024) for _ in range(700)]  # ~66 MiB of heap blocks (under the mmap threshold)
    top = chunks.pop()  # stays alive above the others: what is freed below it is a hole
    del chunks
    before = _rss_mib()
    release_free_memory()
    after = _rss_mib()
    assert before - after > 32, (before, after)
    assert len(top) == 96 * 1024
