"""Shareable artefacts: what a run and its exports write follows the umask, and the
routed Hugging Face export (``dipaco-infer export RUN --format hf --all``) routes and
scores as ``dipaco-infer`` does, loaded by ``dipaco.inference.load_routed`` alone."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import torch

from dipaco.run.checkpoint import CheckpointError
from dipaco.storage.tensor_io import save_tensors
from dipaco.cli import infer as infer_cli
from dipaco.config import compose_config
from dipaco.storage.atomic import current_umask, follow_umask
from dipaco.inference import InferenceRun, export_routed_hf, load_routed
from dipaco.job.train import train

transformers = pytest.importorskip("transformers")

PROMPTS = ["def parse(args):\n    return args", "import os\nimport sys\n", "class Config:\n    name = 'x'",
           "# Copyright 2001 Python Software Foundation\n", "    for i in range(10):\n        total += i",
           "\"\"\"Support for tar archives.\"\"\"\n", "raise ValueError('bad value')", "x = [1, 2, 3]\n"]


def _cli(argv: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["dipaco-infer", *argv])
    capsys.readouterr()
    try:
        infer_cli.main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run and its routed export (``routed/``), written under umask 022."""
    base = tmp_path_factory.mktemp("shared")
    old = os.umask(0o022)
    try:
        train(compose_config(["experiment=smoke", "data.max_documents=200", "trainer.dense_baseline=false",
                              f"data.cache_dir={base / 'cache'}"], base / "run"))
        export_routed_hf(InferenceRun.open(base / "run"), base / "routed")
    finally:
        os.umask(old)
    return base


def test_follow_umask_gives_what_open_and_mkdir_would(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        assert current_umask() == 0o077
        d = tmp_path / "d"
        d.mkdir(mode=0o700)
        os.chmod(d, 0o700)
        f = d / "f"
        f.write_text("x")
        os.chmod(f, 0o600)
        assert stat.S_IMODE(follow_umask(f).stat().st_mode) == 0o600  # private stays private
        os.umask(0o022)
        assert stat.S_IMODE(follow_umask(f).stat().st_mode) == 0o644
        assert stat.S_IMODE(follow_umask(d).stat().st_mode) == 0o755
        save_tensors(tmp_path / "t.safetensors", {"a": torch.zeros(2)})  # safetensors alone writes 0600
        assert stat.S_IMODE((tmp_path / "t.safetensors").stat().st_mode) == 0o644
    finally:
        os.umask(old)


@pytest.mark.slow
def test_routed_export_routes_and_scores_as_dipaco_infer(shared: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Every path as a Llama checkpoint plus the router; load_routed picks the same path as
    ``dipaco-infer route`` for each prompt and the Llama logits match dipaco's to 1e-4."""
    run_dir, out = shared / "run", tmp_path / "routed"
    code, stdout, err = _cli(["export", str(run_dir), "--format", "hf", "--all", "--out", str(out)],
                             capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(stdout)["num_paths"] == 4
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["path_000", "path_001", "path_002", "path_003",
                                                                   "router"]
    routed = load_routed(out)  # the export directory alone: no run directory
    code, stdout, err = _cli(["route", str(run_dir), "--text", *PROMPTS], capsys, monkeypatch)
    assert code == 0, err
    expected = [json.loads(line)["path_id"] for line in stdout.splitlines()]
    assert [routed.route(p) for p in PROMPTS] == expected
    assert len(set(expected)) > 1  # the prompts reach more than one path: routing is exercised
    run = InferenceRun.open(run_dir)
    loader = run.loader()
    for prompt, path in zip(PROMPTS, expected):
        got_path, logits = routed.logits(prompt)
        model = loader.get(path)  # on the run's device (cuda where there is one)
        ids = torch.tensor([run.encode(prompt)], device=next(model.parameters()).device)
        with torch.no_grad():
            ours = model(ids)
        assert got_path == path
        torch.testing.assert_close(logits.cpu(), ours.cpu(), atol=1e-4, rtol=0)
    path, text = routed.generate(PROMPTS[0], max_new_tokens=4)
    assert path == expected[0] and isinstance(text, str)


@pytest.mark.slow
def test_run_and_exports_are_readable_by_group_and_others_under_umask_022(shared: Path) -> None:
    """Checkpoints, router, shards, tokenizer, caches and the exports: 0644 files, 0755 directories."""
    unreadable = [str(p.relative_to(shared)) for p in shared.rglob("*")
                  if stat.S_IMODE(p.stat().st_mode) & (0o055 if p.is_dir() else 0o044) != (0o055 if p.is_dir() else 0o044)]
    assert not unreadable, unreadable[:10]
    assert any((shared / "run" / "checkpoints").rglob("*.safetensors"))
    assert any((shared / "routed").rglob("model.safetensors"))


@pytest.mark.slow
def test_routed_export_refuses_an_altered_file_and_all_without_hf(shared: Path, tmp_path: Path, capsys,
                                                                   monkeypatch) -> None:
    code, _, err = _cli(["export", str(shared / "run"), "--all", "--out", str(tmp_path / "x")], capsys, monkeypatch)
    assert code == 2 and "add --format hf" in err and len(err.strip().splitlines()) == 1
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shared / "routed", copy)
    (copy / "path_001" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="path_001/config.json"):
        load_routed(copy)


def test_a_path_folder_damaged_after_open_is_refused_when_read_and_the_others_load(shared: Path,
                                                                                  tmp_path: Path) -> None:
    """Rule 1 for a routed export read lazily: a path's weights damaged after load_routed
    checked the folder are refused when that path is loaded, naming the file; the other
    paths load (and a path read before is not hashed again while unchanged)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shared / "routed", copy)
    routed = load_routed(copy)
    routed.model(0)
    weights = copy / "path_001" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="path_001/model.safetensors does not match its manifest hash"):
        routed.model(1)
    assert routed.model(2) is not None and routed.model(0) is not None
