"""The benchmark suite is wired up: the entry point's --help works and every module has main(argv).

No timings here (they belong to ``python -m benchmarks``); this only catches a benchmark
that no longer imports or lost its entry point.
"""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = ["quality", "comm", "overhead", "sync_share", "memory", "gpu", "groups", "prepare"]


def test_entry_point_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout and "--only" in proc.stdout


@pytest.mark.parametrize("name", OWN)
def test_bench_module_exposes_main(name: str) -> None:
    mod = importlib.import_module(f"benchmarks.bench_{name}")
    assert callable(mod.main)
    assert list(inspect.signature(mod.main).parameters) == ["argv"]


def test_entry_point_knows_every_script() -> None:
    from benchmarks.__main__ import BENCHMARKS

    scripts = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert scripts <= set(BENCHMARKS), scripts - set(BENCHMARKS)
    assert {"routing", "infer", *OWN} <= set(BENCHMARKS)
