"""``dipaco-infer`` against a hostile user and its operations: a ``config.yaml`` edited after
training, two jobs on one ``--out``, a resume on another device, Ctrl-C, a full disk, a bad
per-line seed, an empty eval data file. Each is refused (or reported) in one line by a rule.

Uses the shared tiny finished run (tests/_hostile.py's ``finished``), copied where edited.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from _hostile import copy_run, one_line, run_cli, snapshot
from dipaco.cli import generate_job, infer_generate
from dipaco.cli.infer import main
from dipaco.inference import InferenceRun, RoutedEngine
from dipaco.run.run_dir import RunDirError

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


# --------------------------------------------------------------------------- one job per --out


def test_a_second_job_on_the_same_out_is_refused_while_the_first_writes(finished, tmp_path, capsys,
                                                                        monkeypatch) -> None:
    """Two writers would each append the lines after the same resume point: duplicates."""
    prompts, out = _prompts(tmp_path), tmp_path / "out.jsonl"
    argv = ["generate", finished[0], "--file", prompts, "--out", out, "--max-new-tokens", "2", "--fast-verify"]
    fd = generate_job.claim(out)  # the first job, still writing (nothing yet)
    try:
        for extra in ([], ["--resume"]):
            code, err = run_cli(main, argv + extra, capsys, monkeypatch)
            assert code == 2
            one_line(err, str(out), "being written by another")
        assert out.read_bytes() == b"" and not generate_job.job_path(out).exists()
    finally:
        os.close(fd)
    code, err = run_cli(main, argv, capsys, monkeypatch)  # the lock went with the first job
    assert code == 0, err
    assert len(out.read_text(encoding="utf-8").splitlines()) == len(PROMPTS)


def test_an_out_on_a_file_system_without_locks_is_written_with_a_note(tmp_path, capsys, monkeypatch) -> None:
    """Some network mounts refuse flock: the guard is skipped, said, not a refusal of the job."""
    def no_locks(*_a):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(generate_job.fcntl, "flock", no_locks)
    fd = generate_job.claim(tmp_path / "out.jsonl")
    os.close(fd)
    assert "cannot be locked" in capsys.readouterr().err


def _args(prompts: Path, **kw) -> argparse.Namespace:
    base = dict(file=str(prompts), max_new_tokens=4, temperature=0.0, top_k=None, top_p=None, seed=0,
                reroute_every=None, ignore_eos=False, text_field="text", fast=False, batch_size=8)
    return argparse.Namespace(**{**base, **kw})


def test_resume_on_another_kind_of_device_is_refused(tmp_path) -> None:
    """CPU and CUDA kernels round differently: the lines would mix two devices' numbers."""
    prompts, out = _prompts(tmp_path), tmp_path / "out.jsonl"
    generate_job.record_job(out, generate_job.describe_job(_args(prompts), {"files": {}}, "cuda", "0" * 64))
    with pytest.raises(RunDirError, match="--device 'cuda'.*'cpu'"):
        generate_job.check_resume(out, generate_job.describe_job(_args(prompts), {"files": {}}, "cpu", "0" * 64))
    generate_job.check_resume(out, generate_job.describe_job(_args(prompts), {"files": {}}, "cuda", "0" * 64))
    # a record from before the device was recorded: continued (it never chose one)
    rec = json.loads(generate_job.job_path(out).read_text(encoding="utf-8"))
    del rec["settings"]["device"]
    generate_job.job_path(out).write_text(json.dumps(rec), encoding="utf-8")
    generate_job.check_resume(out, generate_job.describe_job(_args(prompts), {"files": {}}, "cpu", "0" * 64))


def test_a_prompts_file_that_changes_while_read_is_refused(tmp_path, capsys, monkeypatch) -> None:
    """The record would vouch for the file as it is after the read, not for the prompts
    generated: a resume with the appended file would mix two prompt lists."""
    prompts, out = _prompts(tmp_path), tmp_path / "out.jsonl"
    read = infer_generate.read_jsonl_records

    def read_then_append(path: str, field: str):
        got = read(path, field)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"text": "appended meanwhile"}) + "\n")
        return got

    monkeypatch.setattr(infer_generate, "read_jsonl_records", read_then_append)
    code, err = run_cli(main, ["generate", tmp_path / "no-such-run", "--file", prompts, "--out", out],
                        capsys, monkeypatch)
    assert code == 2
    one_line(err, str(prompts), "changed while it was read")
    assert not out.exists() and not generate_job.job_path(out).exists()


def test_score_never_writes_into_a_run_it_cannot_write(finished, tmp_path, capsys, monkeypatch) -> None:
    """A run on a read-only share: its token cache cannot be written, a temporary one is."""
    run_dir = copy_run(finished[0], tmp_path / "run")
    shutil.rmtree(run_dir / "cache", ignore_errors=True)  # else nothing needs writing
    before = snapshot(run_dir)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *a, **k: (
        False if str(path).startswith(str(run_dir)) and mode & os.W_OK else real(path, mode, *a, **k)))
    code, err = run_cli(main, ["score", run_dir, "--validation", "--fast-verify"], capsys, monkeypatch)
    assert code == 0, err[-2000:]
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------- stopping early


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


def test_a_full_disk_says_what_generate_left_and_exits_1(finished, tmp_path, capsys, monkeypatch) -> None:
    """The boundary's rule for ENOSPC (exit 1: the environment), in the verb's words."""
    prompts, out = _prompts(tmp_path), tmp_path / "out.jsonl"

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(infer_generate._InOrder, "__call__", full)
    code, err = run_cli(main, ["generate", finished[0], "--file", prompts, "--out", out, "--max-new-tokens", "2",
                               "--fast-verify"], capsys, monkeypatch)
    assert code == 1
    line = one_line(err, "no space left", str(out), "--resume")
    assert "checkpoint" not in line and "Errno" not in line


# --------------------------------------------------------------------------- input lines


def test_a_bad_seed_line_is_refused_before_the_run_is_read(tmp_path, capsys, monkeypatch) -> None:
    """Checked with the file, not after the checkpoint is hashed and the job recorded."""
    prompts = _jsonl(tmp_path / "p.jsonl", [{"text": "x = 1"}, {"text": "y = 2", "seed": -1}])
    out = tmp_path / "out.jsonl"
    code, err = run_cli(main, ["generate", tmp_path / "no-such-run", "--file", prompts, "--out", out],
                        capsys, monkeypatch)
    assert code == 2
    one_line(err, "prompt 1 has seed -1", '"seed" field')
    assert not out.exists() and not generate_job.job_path(out).exists()


@pytest.mark.parametrize("argv", [
    ["generate", "RUN", "--file", "P", "--json"],
    ["generate", "RUN", "--prompt", "def f", "--batch-size", "4"],
    ["generate", "RUN", "--prompt", "def f", "--max-loaded-paths", "2"],
    ["generate", "RUN", "--prompt", "def f", "--text-field", "body"],
    ["generate", "RUN", "--prompt", "def f", "--resume"],
    ["score", "RUN", "--validation", "--text-field", "body"],
    ["route", "RUN", "--text", "def f", "--text-field", "body"],
], ids=lambda a: " ".join(a[2:]))
def test_a_flag_that_does_nothing_with_the_input_given_is_refused_before_any_work(tmp_path, capsys, monkeypatch,
                                                                                 argv) -> None:
    """It would be ignored, silently (``--json`` with ``--file`` printed no JSON summary)."""
    places = {"RUN": str(tmp_path / "no-such-run"), "P": str(_prompts(tmp_path))}
    code, err = run_cli(main, [places.get(a, a) for a in argv], capsys, monkeypatch)
    assert code == 2
    flag = next(a for a in argv[3:] if a.startswith("--"))
    one_line(err, f"{flag} goes with", f"not {argv[2]}", f"drop {flag}")


def test_a_run_directory_that_is_a_file_is_named_as_such(tmp_path, capsys, monkeypatch) -> None:
    code, err = run_cli(main, ["route", _prompts(tmp_path), "--text", "def f"], capsys, monkeypatch)
    assert code == 2
    one_line(err, "is not a directory")


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


def _task(folder: Path, name: str, split: str = "test", text: str = "{{question}}") -> Path:
    """A one-document multiple-choice task over a local jsonl file."""
    folder.mkdir(exist_ok=True)
    data = _jsonl(folder / f"{name}.jsonl", [{"question": "def f(x):", "choices": [" return x", " pass"], "label": 0}])
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: {split}\n"
        f"output_type: multiple_choice\ndoc_to_text: '{text}'\ndoc_to_choice: '{{{{choices}}}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n", encoding="utf-8")
    return folder


@pytest.mark.parametrize("task, extra, words", [
    (dict(split="validation"), [], "KeyError"),                   # a split its data_files do not name
    (dict(text="{{prompt}}"), [], "'prompt' is undefined"),        # a field the documents lack
    ({}, ["--num-fewshot", "3"], "Sample larger than population"),  # more shots than documents
], ids=["split", "field", "fewshot"])
def test_eval_a_task_its_data_cannot_serve_is_one_line_naming_it(finished, tmp_path, capsys, monkeypatch, task,
                                                                 extra, words) -> None:
    """lm-eval raises these building or reading the task: the user's YAML, not a dipaco bug."""
    pytest.importorskip("lm_eval")
    tasks = _task(tmp_path / "tasks", "t_x", **task)
    code, err = run_cli(main, ["eval", finished[0], "--tasks", "t_x", "--include-path", tasks, "--fast-verify",
                               *extra], capsys, monkeypatch)
    assert code == 2
    errors = [x for x in err.splitlines() if x.startswith("dipaco: error")]  # lm-eval's bars are on stderr too
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "could not run t_x" in errors[0] and words in errors[0] and "internal error" not in errors[0]


def test_eval_a_failure_in_dipacos_own_code_stays_an_internal_error(finished, tmp_path, capsys, monkeypatch) -> None:
    """The task rule must not hide a dipaco bug: it keeps its traceback file."""
    pytest.importorskip("lm_eval")
    from dipaco.inference import lm_eval_adapter

    def bug(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(lm_eval_adapter, "score_requests", bug)
    monkeypatch.setenv("DIPACO_CRASH_DIR", str(tmp_path))
    tasks = _task(tmp_path / "tasks", "t_x")
    code, err = run_cli(main, ["eval", finished[0], "--tasks", "t_x", "--include-path", tasks, "--fast-verify"],
                        capsys, monkeypatch)
    assert code == 1
    errors = [x for x in err.splitlines() if x.startswith("dipaco: error")]
    assert len(errors) == 1 and "internal error (RuntimeError: a bug)" in errors[0], err[-2000:]
