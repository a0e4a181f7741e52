"""Streaming DiLoCo (issue #34): the staggered schedule, its degenerate case against the
golden file, local ≡ gloo ranks, and resume from a checkpoint taken inside it.

The runs are the golden scenarios' (``tests/golden_run.py``: a [2, 2] grid, H = 4, three
rounds on a seeded synthetic corpus) with ``diloco.streaming=true`` added.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

import golden_run
from test_golden import assert_matches
from dipaco.config import ConfigError, compose_config
from dipaco.config.validate import validate_config
from dipaco.plan.schedule import RoundSchedule
from dipaco.plan.stagger import inflight_peak, peak_bound, stages, streaming_schedule

MODULES = ["embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"]
STREAM = ["diloco.streaming=true"]  # τ = 1, a fragment per stage (embed, L0, L1, head), even spread


def run(tmp: Path, name: str, extra: list[str]) -> dict[str, Any]:
    """A golden scenario (``sync_local`` unless ``name`` is another) with ``extra``
    overrides, trained in a fresh run directory ``tmp/name``."""
    r = golden_run.build_run(tmp / name)
    scenario = golden_run.SCENARIOS.get(name, golden_run.SCENARIOS["sync_local"])
    cfg = compose_config(golden_run.BASE + scenario + extra, r.root)
    golden_run.run_rounds(cfg, r)
    return golden_run.trajectory(r)


# ----------------------------------------------------------------- the schedule
def streaming_points(*args: Any, **kw: Any) -> dict[str, tuple[int, int]]:
    """Each module's ``(launch, land)`` in :func:`streaming_schedule`'s round."""
    return {m: (pt.launch, pt.land) for m, pt in streaming_schedule(*args, **kw).points.items()}


def test_stages_follow_the_path() -> None:
    assert stages(MODULES) == [["embed"], ["L0.0", "L0.1"], ["L1.0", "L1.1"], ["head"]]


def test_one_fragment_and_no_delay_is_the_synchronous_round() -> None:
    one = streaming_schedule(MODULES, 8, 0, fragments=1)
    assert one.is_synchronous and one.points == RoundSchedule.synchronous(MODULES, 8).points


@pytest.mark.parametrize("H,tau", [(8, 1), (8, 2), (12, 3), (4, 1), (4, 3), (50, 5)])
def test_even_spread_lands_every_exchange_in_its_round(H: int, tau: int) -> None:
    """Launches in [1, H − τ], ascending by stage, the last at H − τ; all land by H."""
    pts = streaming_points(MODULES, H, tau)
    launches = [pts[s[0]][0] for s in stages(MODULES)]
    assert launches == sorted(launches) and launches[-1] == H - tau and launches[0] >= 1
    assert all(b == a + tau <= H for a, b in pts.values())
    if H >= 4 * (tau + 1):  # room for the even gaps: one launch every H / 4 steps
        assert all(abs((b - a) - H / 4) <= 1 for a, b in zip(launches, launches[1:]))  # rounded to steps


def test_size_spread_gives_big_fragments_long_gaps() -> None:
    """The embedding and head weigh 4× a level's module: their gaps are longer."""
    sizes = {"embed": 4, "L0.0": 1, "L0.1": 1, "L1.0": 1, "L1.1": 1, "head": 4}
    pts = streaming_points(MODULES, 20, 1, spread="size", sizes=sizes)
    la = [pts[m][0] for m in ("embed", "L0.0", "L1.0", "head")]
    assert la[-1] == 19 and la[1] - la[0] > la[2] - la[1]


def test_peak_in_flight_is_a_fragment_not_the_path() -> None:
    nbytes = {"embed": 400, "L0.0": 100, "L0.1": 100, "L1.0": 100, "L1.1": 100, "head": 400}
    path = ["embed", "L0.0", "L1.0", "head"]
    sync = inflight_peak(RoundSchedule.synchronous(MODULES, 8), path, nbytes)
    stream = inflight_peak(streaming_schedule(MODULES, 8, 1), path, nbytes)
    assert sync == 1000 and stream == 400 <= peak_bound(path, nbytes) == 800


@pytest.mark.parametrize("bad", [["diloco.streaming_delay=4"], ["diloco.streaming_fragments=5"]])
def test_schedule_options_are_checked(bad: list[str], tmp_path: Path) -> None:
    cfg = compose_config(golden_run.BASE + STREAM + bad, tmp_path)
    with pytest.raises(ConfigError):
        validate_config(cfg)


def test_decoupled_mode_refuses_streaming_in_one_line(tmp_path: Path) -> None:
    cfg = compose_config(golden_run.BASE + STREAM + ["diloco.mode=decoupled"], tmp_path)
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.key == "diloco.streaming" and "\n" not in str(e.value).strip()


def test_streaming_options_without_streaming_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        validate_config(compose_config(golden_run.BASE + ["diloco.streaming_delay=2"], tmp_path))


def test_plan_reports_peak_bytes_in_flight(capsys: pytest.CaptureFixture) -> None:
    from dipaco.cli.plan import main
    main(["grid=2x2", "launcher=spawn", "launcher.nproc=4", "diloco.inner_steps=8"] + STREAM)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("peak bytes in flight per path"))
    stream, sync = [int(w.replace(",", "")) for w in line.split(":")[1].split() if w[0].isdigit()][:2]
    assert 0 < stream < sync


# ----------------------------------------------------------------- runs
def test_no_delay_one_fragment_is_the_synchronous_run_bit_for_bit(tmp_path: Path) -> None:
    """τ = 0 with one fragment is synchronous DiLoCo: the same losses and weights (every
    weight's sha256) as the run without streaming, and the golden file's to its tolerance."""
    golden = golden_run.json.loads(golden_run.GOLDEN.read_text())
    got = run(tmp_path, "stream", STREAM + ["diloco.streaming_delay=0", "diloco.streaming_fragments=1"])
    sync = run(tmp_path, "sync", [])
    assert got == sync
    assert_matches(got, golden["sync_local"], "streaming τ=0, one fragment")


def test_staggered_streaming_moves_the_trajectory(tmp_path: Path) -> None:
    """The control: a staggered schedule with mixing lands elsewhere (the test above can fail)."""
    golden = golden_run.json.loads(golden_run.GOLDEN.read_text())
    got = run(tmp_path, "sync_local", STREAM)
    with pytest.raises(AssertionError):
        assert_matches(got, golden["sync_local"], "staggered")
    assert all(math.isfinite(x) for v in got["losses"].values() for x in v)


@pytest.mark.multiprocess
def test_gloo_ranks_overlapping_for_real_equal_the_local_replay(tmp_path: Path) -> None:
    """2 gloo ranks (exchanges on the communication thread, in flight across inner steps)
    land where the local backend's deterministic replay does."""
    extra = STREAM + ["diloco.codec=int4", "diloco.error_feedback=true"]
    local = run(tmp_path, "sync_local", extra)
    gloo = run(tmp_path, "sync_gloo", extra)
    assert_matches(gloo, local, "streaming gloo vs local")


def test_resume_inside_the_staggered_schedule_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Stopped after round 1 (each path's copies differ from θ_global, its tokens since each
    launch are pending), resumed: the same losses and weights as one uninterrupted run."""
    whole = run(tmp_path, "sync_local", STREAM)
    r = golden_run.build_run(tmp_path / "stopped")
    base = golden_run.BASE + golden_run.SCENARIOS["sync_local"] + STREAM
    golden_run.run_rounds(compose_config(base + ["trainer.stop_after_rounds=1"], r.root), r)
    assert (r.checkpoints / "round_000001" / "streams").is_dir()
    golden_run.run_rounds(compose_config(base + ["resume=true"], r.root), r)
    assert_matches(golden_run.trajectory(r), whole, "resumed streaming")
    shutil.rmtree(r.root)


def test_the_default_delay_does_not_refuse_short_rounds_that_do_not_stream(tmp_path: Path) -> None:
    """τ's bound (H − 1) applies only with streaming on: H = 1 runs keep validating."""
    validate_config(compose_config(golden_run.BASE + ["diloco.inner_steps=1"], tmp_path))


@pytest.mark.multiprocess
def test_gloo_resume_inside_the_staggered_schedule_equals_the_uninterrupted_local_run(tmp_path: Path) -> None:
    """The same on 2 gloo ranks: each rank checkpoints its path copies (streams/) and, resumed,
    lands where the uninterrupted local replay does (no exchange lost or applied twice)."""
    whole = run(tmp_path, "sync_local", STREAM)
    r = golden_run.build_run(tmp_path / "stopped_gloo")
    base = golden_run.BASE + golden_run.SCENARIOS["sync_gloo"] + STREAM
    golden_run.run_rounds(compose_config(base + ["trainer.stop_after_rounds=1"], r.root), r)
    assert len(list((r.checkpoints / "round_000001" / "streams").glob("path_*.safetensors"))) == 4
    golden_run.run_rounds(compose_config(base + ["resume=true"], r.root), r)
    assert_matches(golden_run.trajectory(r), whole, "resumed streaming, gloo")


@pytest.mark.multiprocess
def test_worker_groups_of_two_ranks_two_paths_each(tmp_path: Path) -> None:
    """4 gloo ranks in 2 worker groups of 2, each training 2 paths in turn: the exchange's
    all-gather of reduced slices runs on its own group while the inner loop all-reduces
    gradients on the worker group (no deadlock, bounded by launcher.timeout_s); the paths'
    copies swap in and out of the shared live modules; τ = 0 with one fragment equals the
    synchronous run of the same ranks."""
    g2 = ["launcher=spawn", "launcher.nproc=4", "launcher.group_size=2", "launcher.timeout_s=240"]

    def g2_run(name: str, extra: list[str]) -> dict[str, Any]:
        r = golden_run.build_run(tmp_path / name)
        golden_run.run_rounds(compose_config(golden_run.BASE + g2 + extra, r.root), r)
        return golden_run.trajectory(r)

    sync = g2_run("sync", [])
    assert_matches(g2_run("tau0", STREAM + ["diloco.streaming_delay=0", "diloco.streaming_fragments=1"]), sync,
                   "G=2 streaming τ=0 vs sync")
    staggered = g2_run("staggered", STREAM + ["diloco.codec=int8", "diloco.error_feedback=true"])
    assert all(math.isfinite(x) for v in staggered["losses"].values() for x in v)
