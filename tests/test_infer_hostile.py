"""``dipaco-infer`` against a hostile user and its operations: a ``config.yaml`` edited after
training, two jobs on one ``--out``, a resume on another device, Ctrl-C, a bad per-line
seed, an empty eval data file. Each is refused (or reported) in one line by a rule.

Uses the shared tiny finished run (tests/_hostile.py's ``finished``), copied where edited.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _hostile import copy_run, one_line, run_cli
from dipaco.cli.infer import main
from dipaco.inference import InferenceRun, RoutedEngine

PROMPTS = ["def main():\n    ", "import os\n", "class Foo:\n"]


def _jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def _prompts(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "p.jsonl", [{"text": t} for t in PROMPTS])


# --------------------------------------------------------------------------- the run's config


@pytest.mark.parametrize("edit", [("rope_theta: 10000.0", "rope_theta: 500.0", "model.rope_theta"),
                                  ("norm_eps: 1.0e-05", "norm_eps: 0.5", "model.norm_eps")])
def test_a_config_edited_after_training_is_refused_by_every_verb(finished, tmp_path, capsys, monkeypatch,
                                                                 edit) -> None:
    """Edited, it would build the weights into another model and generate other tokens silently."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    cfg = run_dir / "config.yaml"
    text = cfg.read_text(encoding="utf-8")
    assert edit[0] in text
    cfg.write_text(text.replace(edit[0], edit[1]), encoding="utf-8")
    for argv in (["generate", run_dir, "--prompt", "def f", "--max-new-tokens", "2"],
                 ["route", run_dir, "--text", "def f"]):
        code, err = run_cli(main, argv, capsys, monkeypatch)
        assert code == 2
        one_line(err, edit[2], "config.yaml")
    # a key that says how to run, not what the weights are, may still change
    cfg.write_text(text.replace("eval_batch_size:", "eval_batch_size: 3 #"), encoding="utf-8")
    InferenceRun.open(run_dir, need_weights=False)


# --------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_says_what_the_verb_left_and_how_to_go_on(finished, tmp_path, capsys, monkeypatch) -> None:
    """Not the training run's "resume=true continues from the last checkpoint"."""
    prompts, out = _prompts(tmp_path), tmp_path / "out.jsonl"

    def interrupt(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(RoutedEngine, "generate", interrupt)
    code, err = run_cli(main, ["generate", finished[0], "--file", prompts, "--out", out, "--max-new-tokens", "2",
                               "--fast-verify"], capsys, monkeypatch)
    assert code == 1
    line = one_line(err, "interrupted", str(out), "--resume")
    assert "resume=true" not in line and "checkpoint" not in line
    monkeypatch.setattr(InferenceRun, "generate", interrupt)
    code, err = run_cli(main, ["generate", finished[0], "--prompt", "def f", "--fast-verify"], capsys, monkeypatch)
    assert code == 1 and "Traceback" not in err
    errors = [x for x in err.splitlines() if x.startswith("dipaco: error")]  # after the short-prompt note
    assert len(errors) == 1 and "interrupted" in errors[0] and "run the command again" in errors[0], err
    assert "resume=true" not in errors[0]


# --------------------------------------------------------------------------- input lines


def test_eval_refuses_an_empty_or_folder_data_file_naming_it(tmp_path) -> None:
    """datasets fails on them deep inside lm-eval (an internal error before)."""
    pytest.importorskip("lm_eval")
    from dipaco.inference.lm_eval_adapter import LmEvalError, _check_local

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    for path, words in ((empty, "is empty"), (tmp_path, "not a regular file"), (tmp_path / "gone.jsonl", "not exist")):
        with pytest.raises(LmEvalError, match=words):
            _check_local("t", {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}}})
    empty.write_text('{"text": "x"}\n', encoding="utf-8")
    _check_local("t", {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(empty)}}})
