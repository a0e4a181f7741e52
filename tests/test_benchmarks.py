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
OWN = ["quality", "comm", "overhead", "sync_share", "memory", "gpu", "groups", "prepare", "link", "serving"]


@pytest.mark.multiprocess
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


def test_link_benchmark_skips_with_a_message_when_it_cannot_shape(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """Not root: bench_link says why and skips instead of failing (issue #34 item 5)."""
    from benchmarks import bench_link

    monkeypatch.setattr(bench_link.os, "geteuid", lambda: 1000)
    monkeypatch.delenv(bench_link.INSIDE, raising=False)
    assert "not root" in bench_link.main([])["skipped"]
    assert "skipped: cannot shape a link here (not root" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.multiprocess  # dipaco-serve in a subprocess
def test_the_serving_benchmark_runs_tiny(finished, tmp_path) -> None:
    """bench_serve --tiny: dipaco-serve and the in-process engine on the same 8 prompts."""
    from benchmarks import bench_serve

    out = bench_serve.main(["--tiny", "--run-dir", str(finished[0]), "--out", str(tmp_path / "serve.json")])
    assert out["prompts"] == 8 and 0 < out["server"]["tokens"] <= 64 and 0 < out["engine"]["tokens"] <= 64
    assert out["server"]["latency_p99_s"] >= out["server"]["latency_p50_s"] > 0


@pytest.mark.slow
@pytest.mark.multiprocess  # the per-process sides and the export are subprocesses
def test_serving_benchmark_tiny_runs_its_sides(finished, tmp_path: Path) -> None:
    """bench_serving --tiny on the shared tiny run: each side measured, the engine's greedy
    tokens equal to transformers' on the Llama export, the server's as many as the engine's."""
    from benchmarks import bench_serving

    # the fast sides are the same commands with --fast (tests/test_engine.py covers the mode)
    out = bench_serving.main(["--tiny", "--run", str(finished[0]), "--work-dir", str(tmp_path),
                              "--sides", "per_process,engine_process,engine_loop,hf,server"])
    assert set(out["sides"]) == {"per_process", "engine_process", "engine_loop", "hf", "server"}
    assert all(s["tokens_s"] > 0 for s in out["sides"].values())
    assert out["sides"]["hf"]["same_tokens_as_engine"] >= 0.5  # left padding may flip a near-tie
    # greedy, the same prompts: the server (text in, as a client sends it) generates what --file does
    assert out["sides"]["server"]["tokens"] == out["sides"]["engine_process"]["tokens"]
    assert out["verdicts"]["server_vs_engine_process_tokens"] > 0
    from dipaco.inference import InferenceRun
    from dipaco.serve.engine_pool import engine_processes

    paths = InferenceRun.open(finished[0], need_weights=False).num_paths
    assert out["sides"]["server"]["engine_processes"] == engine_processes(None, "cpu", paths)  # /health's count


def test_round_trace_notes_the_projects_calls_only_while_on() -> None:
    """benchmarks/round_trace.py's hook: a call into the project is noted under its file,
    a call elsewhere (the standard library) is not, and nothing is noted while off."""
    import json

    from benchmarks.round_trace import RoundTrace
    from dipaco.config import TrainerConfig
    from dipaco.config.schedule import lr_at

    from dipaco.storage.hashing import sha256_hex

    trace = RoundTrace()
    sys.setprofile(trace.profile)
    try:
        sha256_hex("off")  # off: not noted
        trace.on = True
        lr_at(1, 10, TrainerConfig())
        json.dumps({"a": 1})
    finally:
        sys.setprofile(None)
    assert list(trace.files) == ["dipaco/config/schedule.py"]
    assert "lr_at" in trace.files["dipaco/config/schedule.py"]


def test_round_trace_reads_the_rounds_own_lines_and_counts_bounces() -> None:
    """The reading set holds the lines of the functions called in the round's own files
    (a black box's are not read), and a call path that returns to a file is a bounce."""
    import inspect

    from benchmarks.round_trace import RoundTrace, black_box, depth
    from dipaco.config import TrainerConfig
    from dipaco.config.schedule import lr_at
    from dipaco.plan.schedule import RoundSchedule

    trace = RoundTrace()
    trace.on = trace.in_round = True
    sys.setprofile(trace.profile)
    try:
        RoundSchedule.synchronous(["a"], 4).boundaries()
        lr_at(1, 10, TrainerConfig())  # a black box: entered, not read
    finally:
        sys.setprofile(None)
    assert black_box("dipaco/config/schedule.py") and black_box("modules/grid.py")
    assert list(trace.reading) == ["dipaco/plan/schedule.py"]
    called = (RoundSchedule.synchronous, RoundSchedule.__init__, RoundSchedule.boundaries)
    want = set()
    for f in called:
        src, first = inspect.getsourcelines(inspect.unwrap(f))
        want |= set(range(first, first + len(src)))  # its decorators, definition and body
    assert trace.reading["dipaco/plan/schedule.py"] == want
    assert depth(["loop", "driver", "syncs", "driver", "core"]) == (4, 1)
    assert depth(["loop", "driver", "sync", "core"]) == (4, 0)
