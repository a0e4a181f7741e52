"""Reliability (issue 8): inject faults into real tiny runs and check what the system does.

Every fault, what the system does and which test shows it is listed in
docs/reliability.md. Most tests start from one shared local-backend run stopped after
round 2 of 3 (``base_run``) and work on copies of its run directory, so each fault costs
at most one or two rounds instead of a whole run. The single multi-process test (a rank
killed by SIGKILL) starts two gloo ranks once.
"""
from __future__ import annotations

import json
import os
import pickle  # only to *write* a hostile file in a test; the project never reads pickle
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.runtime import faults
from dipaco.run.checkpoint import CheckpointError, CheckpointManager, load_state, sha256_file, write_json
from dipaco.config import ConfigError, compose_config
from dipaco.runtime.launch import LaunchError
from dipaco.run.run_dir import RunDirError, RunStopped
from dipaco.job.train import train

REPO = Path(__file__).resolve().parents[1]
# every directory of importable project code (tests may write hostile pickles on purpose)
PROJECT_CODE = ("dipaco", "router", "modules", "benchmarks", "conf")

# 4 paths ([2,2] grid) on 2 worker groups, 3 rounds of H=2, no dense baseline, tiny eval.
# Nesterov (not the default plain averaging) so that the outer optimiser has momentum
# state that a resume must carry.
BASE = ["experiment=smoke", "data.max_documents=200", "launcher=local", "launcher.nproc=2",
        "diloco=nesterov", "diloco.inner_steps=2", "trainer.rounds=3", "trainer.keep_last=3",
        "trainer.dense_baseline=false", "trainer.eval_max_documents=8"]


def run_train(run_dir: Path, *extra: str) -> dict:
    return train(compose_config(BASE + list(extra), run_dir))


def ckpt_dir(run_dir: Path, round_idx: int) -> Path:
    return run_dir / "checkpoints" / f"round_{round_idx:06d}"


def module_weights(run_dir: Path, round_idx: int) -> dict[str, dict[str, torch.Tensor]]:
    return {p.stem: load_state(p) for p in sorted((ckpt_dir(run_dir, round_idx) / "modules").glob("*.safetensors"))}


def assert_same(a: dict, b: dict, *, exact: bool, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for mid in a:
        assert a[mid].keys() == b[mid].keys()
        for k in a[mid]:
            if exact:
                assert torch.equal(a[mid][k], b[mid][k]), f"{mid}/{k} differs"
            else:
                torch.testing.assert_close(a[mid][k], b[mid][k], atol=atol, rtol=1e-5, msg=f"{mid}/{k}")


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local run (2 worker groups, 4 paths) stopped after round 2 of 3: checkpoints 1 and 2."""
    run_dir = tmp_path_factory.mktemp("base")
    out = run_train(run_dir, "trainer.stop_after_rounds=2")
    assert out["stopped_at_round"] == 2
    return run_dir


@pytest.fixture
def copy_of_base(base_run: Path, tmp_path: Path) -> Path:
    """A private copy of the base run directory, to corrupt or resume."""
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst)
    return dst


# ----------------------------------------------------------------- 3. corrupt checkpoints


def _truncate(ckpt: Path) -> str:
    f = ckpt / "modules" / "L0.0.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return "does not match its manifest"


def _flip_byte(ckpt: Path) -> str:
    f = ckpt / "paths" / "path_1.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) - 7] ^= 0xFF  # inside the tensor bytes: still a loadable file, wrong numbers
    f.write_bytes(bytes(data))
    return "does not match its manifest"


def _drop_manifest(ckpt: Path) -> str:
    (ckpt / "manifest.json").unlink()
    return "has no manifest.json"


def _missing_file(ckpt: Path) -> str:
    (ckpt / "outer" / "head.safetensors").unlink()
    return "listed in the manifest but missing"


def _garbled_manifest(ckpt: Path) -> str:
    (ckpt / "manifest.json").write_text("{\"files\": [tr")
    return "unreadable manifest"


def _planted_pickle(ckpt: Path) -> str:
    (ckpt / "modules" / "L0.0.pt").write_bytes(pickle.dumps({"weight": [1.0, 2.0]}))
    return "files not in its manifest"


CORRUPTIONS = {"truncated": _truncate, "flipped_byte": _flip_byte, "no_manifest": _drop_manifest,
               "manifest_names_missing_file": _missing_file, "garbled_manifest": _garbled_manifest,
               "planted_pickle": _planted_pickle}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_detected_and_skipped(kind: str, base_run: Path, tmp_path: Path) -> None:
    """Each corruption of the newest checkpoint is named; latest_valid falls back one round."""
    root = tmp_path / "checkpoints"
    shutil.copytree(base_run / "checkpoints", root)
    expected = CORRUPTIONS[kind](root / "round_000002")
    with pytest.raises(CheckpointError, match=re.escape(expected)):
        CheckpointManager.verify(root / "round_000002")
    messages: list[str] = []
    assert CheckpointManager(root).latest_valid(log=messages.append) == root / "round_000001"
    assert len(messages) == 1 and "round_000002" in messages[0] and expected in messages[0]


@pytest.mark.slow
def test_truncated_file_without_manifest_check_is_a_clear_error(base_run: Path, tmp_path: Path) -> None:
    """Reading a damaged file directly (no manifest involved) raises CheckpointError, not a safetensors panic."""
    src = ckpt_dir(base_run, 2) / "modules" / "L0.0.safetensors"
    for name, data in {"half": src.read_bytes()[: src.stat().st_size // 2], "empty": b"",
                       "header_only": src.read_bytes()[:8]}.items():
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(data)
        with pytest.raises(CheckpointError, match="corrupt checkpoint file"):
            load_state(f)
    with pytest.raises(CheckpointError, match="missing checkpoint file"):
        load_state(tmp_path / "absent.safetensors")


@pytest.mark.slow
def test_pickle_planted_as_weights_is_never_unpickled(base_run: Path, tmp_path: Path) -> None:
    """A pickle in place of a weights file, even with a forged manifest, is refused without running it."""
    ckpt = tmp_path / "round_000002"
    shutil.copytree(ckpt_dir(base_run, 2), ckpt)
    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {sentinel}",))

    target = ckpt / "modules" / "L0.0.safetensors"
    target.write_bytes(pickle.dumps(Exploit()))
    # forge the manifest so the hash check passes: only the loader stands in the way
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["modules/L0.0.safetensors"] = {"sha256": sha256_file(target), "bytes": target.stat().st_size}
    write_json(ckpt / "manifest.json", manifest)
    CheckpointManager.verify(ckpt)
    with pytest.raises(CheckpointError, match="corrupt checkpoint file"):
        load_state(target)
    assert not sentinel.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["module_byte", "state_json"])
def test_resume_falls_back_over_a_corrupt_checkpoint(base_run: Path, copy_of_base: Path, capsys, damage) -> None:
    """A flipped byte in round 2's module file, or its state.json garbled (the resume's
    preflight refused the whole run for it): resume=true says it skips round 2, restarts
    from round 1 and re-makes round 2 bit for bit."""
    original = module_weights(base_run, 2)
    if damage == "module_byte":
        _flip_byte(ckpt_dir(copy_of_base, 2))
    else:
        (ckpt_dir(copy_of_base, 2) / "state.json").write_text('{"round": 2, "lev')
    capsys.readouterr()
    out = run_train(copy_of_base, "resume=true", "trainer.stop_after_rounds=2")
    said = capsys.readouterr()
    assert "skipping checkpoint" in said.out + said.err and "round_000002" in said.out + said.err
    assert out["stopped_at_round"] == 2
    CheckpointManager.verify(ckpt_dir(copy_of_base, 2))
    assert_same(module_weights(copy_of_base, 2), original, exact=True)


@pytest.mark.slow
def test_crash_while_writing_a_checkpoint_keeps_the_previous_one(
        base_run: Path, copy_of_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash half-way through writing round 2 leaves a .partial directory and round 1 intact."""
    import dipaco.rounds.checkpointing as trainer  # where the rounds loop's checkpoints are written

    shutil.rmtree(ckpt_dir(copy_of_base, 2))  # as if the run had been stopped after round 1
    real_save = trainer.save_state
    written: list[str] = []

    def dying_save(path: Path, state: Any) -> None:
        if "round_000002" in str(path) and "paths" in str(path):
            raise OSError(28, "No space left on device (injected)")
        written.append(str(path))
        real_save(path, state)

    monkeypatch.setattr(trainer, "save_state", dying_save)
    with pytest.raises(RunStopped, match="disk full .* last complete checkpoint: .*round_000001"):
        run_train(copy_of_base, "resume=true", "trainer.stop_after_rounds=2")
    assert any("round_000002.partial" in w for w in written), "the crash must hit mid-write"
    assert (copy_of_base / "checkpoints" / "round_000002.partial").is_dir()
    assert not ckpt_dir(copy_of_base, 2).exists()
    assert CheckpointManager(copy_of_base / "checkpoints").latest_valid() == ckpt_dir(copy_of_base, 1)

    monkeypatch.setattr(trainer, "save_state", real_save)
    run_train(copy_of_base, "resume=true", "trainer.stop_after_rounds=2")
    assert not (copy_of_base / "checkpoints" / "round_000002.partial").exists()
    assert_same(module_weights(copy_of_base, 2), module_weights(base_run, 2), exact=True)


# ----------------------------------------------------------------- 4. non-finite updates


@pytest.mark.slow
def test_non_finite_pseudo_gradient_is_dropped_and_counted(
        base_run: Path, copy_of_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN in path 1's head and +inf in path 2's embed (round 3): both dropped, counted, never applied."""
    monkeypatch.setenv(faults.ENV, "nan:path=1:round=3:module=head;inf:path=2:round=3:module=embed")
    summary = run_train(copy_of_base, "resume=true")
    assert summary["rounds"] == 3
    last = metrics(copy_of_base)[-1]
    assert last["round"] == 3
    mods = last["modules"]
    for mid in ("head", "embed"):  # shared by all 4 paths: 3 contributions applied, 1 dropped
        assert mods[mid]["dropped"] == 1 and mods[mid]["contributions"] == 3 and mods[mid]["stepped"], mid
    assert all(m["dropped"] == 0 for mid, m in mods.items() if mid not in ("head", "embed"))
    assert last["paths"]["1"]["dropped_modules"] == ["head"]
    assert last["paths"]["2"]["dropped_modules"] == ["embed"]
    assert last["paths"]["0"]["dropped_modules"] == []
    before, after = module_weights(copy_of_base, 2), module_weights(copy_of_base, 3)
    for mid, sd in after.items():
        for k, v in sd.items():
            assert torch.isfinite(v).all(), f"{mid}/{k} holds a non-finite value"
            assert not torch.equal(v, before[mid][k]), f"{mid}/{k} did not move: the other paths were lost"
    for name in ("head", "embed"):
        outer = load_state(ckpt_dir(copy_of_base, 3) / "outer" / f"{name}.safetensors")
        assert all(torch.isfinite(v).all() for v in outer.values())
    assert summary["routed_ppl"] == summary["routed_ppl"]  # not NaN: evaluation ran on finite weights


def test_non_finite_gradient_skips_the_inner_step() -> None:
    """A NaN gradient (e.g. an overflowing loss) is not applied, so AdamW's moments stay finite."""
    from dipaco.config import TrainerConfig
    from dipaco.rounds.learner import PathLearner

    class Stream:
        def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.randint(0, 16, (2, 8), generator=gen)
            return x, torch.roll(x, -1, dims=1)

        def state_dict(self) -> dict:
            return {}

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    calls = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 2 else grad  # the second step only

    model[1].weight.register_hook(poison)
    learner = PathLearner(0, model, Stream(), TrainerConfig(warmup_steps=0, grad_clip=1.0), total_steps=4)
    stats = learner.train_steps(4)
    assert stats.skipped == 1 and stats.steps == 3 and learner.step == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for st in learner.optimizer.state.values():
        assert all(torch.isfinite(v).all() for v in st.values() if isinstance(v, torch.Tensor))
    assert stats.loss == stats.loss  # the mean loss of the applied steps is finite


# ----------------------------------------------------------------- 5. compute joins


@pytest.mark.slow
def test_more_worker_groups_on_resume_keep_every_path_and_module_state(
        base_run: Path, copy_of_base: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """2 worker groups for rounds 1–2, 4 for round 3: paths re-dealt, outer state carried.

    The reference resumes the same checkpoint with 2 groups: with an exact codec the
    grouping only changes the order of a sum, so both land on the same weights (allclose).
    A reset outer optimiser or a lost path would move them apart.
    """
    reference = tmp_path / "reference"
    shutil.copytree(base_run, reference)
    run_train(reference, "resume=true")
    capsys.readouterr()
    run_train(copy_of_base, "resume=true", "launcher.nproc=4")
    assert "paths are re-dealt" in capsys.readouterr().out
    last = metrics(copy_of_base)[-1]
    assert last["round"] == 3 and set(last["paths"]) == {"0", "1", "2", "3"}
    assert last["modules"]["embed"]["contributions"] == 4
    assert all(m["contributions"] == 2 for mid, m in last["modules"].items() if mid.startswith("L"))
    assert_same(module_weights(copy_of_base, 3), module_weights(reference, 3), exact=False, atol=1e-5)
    ref_outer = load_state(ckpt_dir(reference, 3) / "outer" / "embed.safetensors")
    new_outer = load_state(ckpt_dir(copy_of_base, 3) / "outer" / "embed.safetensors")
    torch.testing.assert_close(new_outer, ref_outer, atol=1e-5, rtol=1e-5)  # momentum carried


@pytest.mark.slow
def test_error_feedback_residuals_are_dropped_when_groups_change(
        base_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Residuals are keyed by worker group: kept on the same grouping, dropped (logged) on another."""
    from dipaco.sync.diloco import DiLoCoSync
    from dipaco.plan.build import build_grid, build_topology
    from dipaco.rounds.checkpointing import load_checkpoint as _load_checkpoint

    ckpt = tmp_path / "round_000002"
    shutil.copytree(ckpt_dir(base_run, 2), ckpt)
    cfg = compose_config(BASE + ["diloco.codec=int8", "diloco.error_feedback=true"])
    for f in (ckpt / "outer").glob("*.safetensors"):  # give every module group residuals to carry
        state = load_state(f)
        n = state["global"].numel()
        state.update({"residual.0": torch.full((n,), 0.5), "residual.1": torch.full((n,), -0.5)})
        from dipaco.run.checkpoint import save_state

        save_state(f, state)

    def load(nproc: int) -> DiLoCoSync:
        cfg.launcher.nproc = nproc
        grid = build_grid(cfg)
        topo = build_topology(cfg, grid, 1, distributed=False)
        modules = {m: grid.module(m) for m in grid.module_ids}
        sync = DiLoCoSync(topo, modules, codec="int8", error_feedback=True)
        assert _load_checkpoint(ckpt, grid, sync, {}, list(grid.module_ids), topo) == 2
        return sync

    same = load(2)
    assert any(s.residuals for s in same.syncs.values())
    assert "re-dealt" not in capsys.readouterr().out
    regrouped = load(4)
    assert all(not s.residuals for s in regrouped.syncs.values())
    assert "error-feedback residuals are dropped" in capsys.readouterr().out


# ----------------------------------------------------------------- 6. hostile input


@pytest.mark.slow
def test_hostile_jsonl_corpus_trains_with_documented_skips(base_run: Path, tmp_path: Path) -> None:
    """Empty, binary, non-UTF-8, huge, malformed and mistyped records: skipped or truncated, counted."""
    from dipaco.data import load_corpus

    good = [json.loads(x) for x in _stdlib_docs_as_jsonl(base_run)]
    lines: list[bytes] = [json.dumps(d).encode() for d in good]
    hostile = [
        b"",  # blank line
        b'{"text": ""}',  # empty
        b'{"text": "   \\n\\t  "}',  # whitespace only
        b'{"text": "abc\\u0000def' + b"x" * 100 + b'"}',  # NUL: binary
        b'{"text": "caf\xe9 ' + b"y" * 100 + b'"}',  # latin-1 byte: not UTF-8
        b'\x89PNG\x00\x00\x1a IHDR\xff\xfe',  # raw binary line (no newline bytes inside)
        b'{"text": "unterminated',  # malformed JSON
        b'[1, 2, 3]',  # JSON but not an object
        b'{"body": "no text field here, long enough to count as a document .........."}',
        b'{"text": 12345}',  # not a string
        json.dumps({"text": "def huge():\n" + "    x = 1\n" * 400_000}).encode(),  # ~4 MB
    ]
    path = tmp_path / "hostile.jsonl"
    path.write_bytes(b"\n".join(lines[:50] + hostile + lines[50:]) + b"\n")
    over = ["data=jsonl", f"data.path={path}", "data.max_documents=null", "trainer.rounds=1",
            "diloco.inner_steps=1", "trainer.keep_last=1"]
    cfg = compose_config(BASE + over, tmp_path / "run")
    corpus = load_corpus(cfg.data, progress=False)
    sk = corpus.skipped
    assert sk.get("malformed_json") == 2 and sk.get("non_utf8") == 2 and sk.get("binary") == 1, sk
    assert sk.get("empty") == 2 and sk.get("missing_text_field") == 1 and sk.get("not_a_string") == 1, sk
    assert sk.get("blank_line") == 1 and sk.get("truncated") == 1, sk
    assert max(len(t) for t in corpus.dataset["text"]) <= cfg.data.max_doc_chars
    summary = train(cfg)
    assert summary["routed_ppl"] == summary["routed_ppl"] and (tmp_path / "run" / "summary.json").is_file()


def _stdlib_docs_as_jsonl(base_run: Path) -> list[str]:
    """~200 ordinary documents (the smoke corpus) as JSON lines."""
    from dipaco.data import load_corpus

    cfg = compose_config(BASE)
    ds = load_corpus(cfg.data, progress=False).dataset
    return [json.dumps({"text": t}) for t in ds["text"]]


@pytest.mark.slow
def test_router_from_a_different_grid_is_refused(base_run: Path, tmp_path: Path) -> None:
    """Resuming a run whose config.yaml was hand-edited to grid [4] while router/ was fitted
    for [2,2], its fingerprints.json deleted: a clear error (what the artefacts were made
    from is unknown: never a pass), nothing rewritten."""
    run = _regridded_copy(base_run, tmp_path)
    with pytest.raises(RunDirError, match=r"but no fingerprints.json"):
        train(compose_config(["resume=true"], run), overrides=["resume=true"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round_000001", "round_000002"]


def _regridded_copy(base_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    (run / "fingerprints.json").unlink()
    cfg = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(cfg.replace("levels:\n  - 2\n  - 2\n", "levels:\n  - 4\n"))
    return run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_router_from_a_different_grid_is_one_line_in_the_cli(base_run: Path, tmp_path: Path) -> None:
    run = _regridded_copy(base_run, tmp_path)
    proc = subprocess.run([sys.executable, "-c", "from dipaco.cli.train import main; main()",
                           "resume=true", f"hydra.run.dir={run}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-1500:]
    assert "but no fingerprints.json" in proc.stderr


@pytest.mark.parametrize(("override", "key"), [("diloco.codec=gzip", "diloco.codec"),
                                               ("diloco.inner_steps=-1", "diloco.inner_steps")])
def test_bad_config_stops_before_any_work(override: str, key: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        run_train(tmp_path, override)
    assert err.value.key == key
    assert not (tmp_path / "tokenizer.json").exists() and not (tmp_path / "config.yaml").exists()


@pytest.mark.slow
def test_resume_skips_a_checkpoint_holding_a_planted_pickle(
        base_run: Path, copy_of_base: Path, capsys: pytest.CaptureFixture) -> None:
    """resume=true never reads a file the manifest does not name: it goes back to round 1."""
    _planted_pickle(ckpt_dir(copy_of_base, 2))
    run_train(copy_of_base, "resume=true", "trainer.stop_after_rounds=2")
    out = capsys.readouterr().out
    assert "files not in its manifest" in out and "resumed from round_000001" in out


# ----------------------------------------------------------------- 7. no pickle


def _unpickling_calls(source: str) -> list[tuple[int, str]]:
    """Lines whose *code* (not comments or strings) can unpickle: found on the token stream."""
    import io
    import tokenize

    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    found = []
    for i, t in enumerate(toks):
        nxt = [x.string for x in toks[i + 1 : i + 3]]
        if t.string in ("pickle", "_pickle", "cPickle", "dill", "joblib", "shelve", "marshal"):
            found.append((t.start[0], f"uses {t.string}"))
        elif t.string == "torch" and nxt == [".", "load"]:
            found.append((t.start[0], "torch.load"))
        elif t.string == "allow_pickle" and nxt == ["=", "True"]:
            found.append((t.start[0], "allow_pickle=True"))
        elif t.string == "weights_only" and nxt == ["=", "False"]:
            found.append((t.start[0], "weights_only=False"))
    return found


def test_source_tree_never_unpickles() -> None:
    """No ``torch.load``, ``pickle``, ``allow_pickle=True`` in the project's code (tests excluded:
    they write hostile pickles on purpose)."""
    offenders = [f"{f.relative_to(REPO)}:{line}: {what}"
                 for top in PROJECT_CODE for f in sorted((REPO / top).rglob("*.py"))
                 for line, what in _unpickling_calls(f.read_text(encoding="utf-8"))]
    assert not offenders, "pickle-capable loading found:\n" + "\n".join(offenders)


def test_unpickling_detector_sees_code_not_prose() -> None:
    """The grep above must catch real calls (else it proves nothing) and ignore docstrings."""
    code = "import pickle\nx = torch.load(f)\nnp.load(f, allow_pickle=True)\n"
    assert [w for _, w in _unpickling_calls(code)] == ["uses pickle", "torch.load", "allow_pickle=True"]
    assert _unpickling_calls('"""no pickle, no torch.load(x)"""  # allow_pickle=True\n') == []


# ----------------------------------------------------------------- 1. a rank dies (gloo ranks)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_killed_rank_stops_the_run_and_resume_finishes(
        base_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 of 2 SIGKILLs itself in round 2's inner phase: LaunchError in bounded time,
    round 1 intact, and resume=true (fault gone, now on the local backend) finishes."""
    run = tmp_path / "run"
    monkeypatch.setenv(faults.ENV, "kill:rank=1:round=2")  # spawned ranks inherit the environment
    t0 = time.time()
    with pytest.raises(LaunchError, match="rank 1"):
        run_train(run, "launcher=spawn", "launcher.nproc=2", "launcher.timeout_s=60")
    failed_at = time.time()
    round1 = ckpt_dir(run, 1)
    CheckpointManager.verify(round1)
    # the agent notices within seconds of round 1's commit (after which rank 1 died)
    assert failed_at - (round1 / "manifest.json").stat().st_mtime < 60, f"took {failed_at - t0:.0f} s in all"
    assert [r["round"] for r in metrics(run)] == [1]
    assert not ckpt_dir(run, 2).exists()

    monkeypatch.delenv(faults.ENV)
    summary = run_train(run, "resume=true")  # local backend, the same 2 worker groups
    assert summary["rounds"] == 3 and [r["round"] for r in metrics(run)] == [1, 2, 3]
    # nothing committed was lost: round 2 continues from the spawned ranks' round 1 and
    # lands where the all-local base run landed (contract 1: allclose across backends)
    assert_same(module_weights(run, 2), module_weights(base_run, 2), exact=False, atol=1e-5)
