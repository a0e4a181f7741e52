"""``dipaco-infer generate --file``: one JSON line per prompt in input order, the tokens of
``--prompt``, whole lines after a SIGKILL, ``--resume``, and bad input as one line.

Uses the shared tiny finished run (tests/_hostile.py's ``finished``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _hostile import one_line, run_cli
from dipaco.cli.infer import main
from dipaco.cli.infer_generate import prompt_seed
from dipaco.inference import InferenceRun

TEXTS = ["def main():\n    ", "import os\n", "class Foo:\n    def __init__(self):", "x", "for i in range(10):\n",
         "with open(path) as f:\n    data = ", "try:\n    import numpy as np\nexcept ImportError:\n", "return "]


def _jsonl(path: Path, texts: list[str], extra: tuple[str, ...] = ()) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": f"q{i}"}) + "\n" for i, t in enumerate(texts))
                    + "".join(x + "\n" for x in extra), encoding="utf-8")
    return path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def test_file_writes_each_prompt_in_order_with_its_one_prompt_tokens(finished, tmp_path, capsys, monkeypatch) -> None:
    run_dir = finished[0]
    prompts = _jsonl(tmp_path / "p.jsonl", TEXTS, extra=("not json", json.dumps({"text": "x = 1", "seed": 5})))
    out = tmp_path / "out.jsonl"
    code, err = run_cli(main, ["generate", run_dir, "--file", prompts, "--out", out, "--max-new-tokens", "5",
                               "--temperature", "0.9", "--top-p", "0.9", "--batch-size", "3", "--seed", "7"],
                        capsys, monkeypatch)
    assert code == 0, err
    assert "skipped 1 line" in err and "malformed_json=1" in err
    lines = _lines(out)
    assert [x["index"] for x in lines] == list(range(len(TEXTS) + 1))
    assert [x.get("id") for x in lines] == [f"q{i}" for i in range(len(TEXTS))] + [None]
    assert lines[-1]["seed"] == 5 and lines[0]["seed"] == prompt_seed(7, 0) != prompt_seed(7, 1)
    run = InferenceRun.open(run_dir)
    for i in (0, 3, len(TEXTS)):
        ids = run.encode((TEXTS + ["x = 1"])[i])
        ref = run.generate(ids, max_new_tokens=5, temperature=0.9, top_p=0.9, seed=lines[i]["seed"])
        assert lines[i]["tokens"] == ref.tokens
        assert lines[i]["text"] == run.tokenizer.decode(ref.tokens, skip_special_tokens=True)
        assert lines[i]["prompt_tokens"] == len(ids) and lines[i]["path_sequence"] == ref.window_paths


def test_a_lines_text_holds_no_end_of_text_marker(finished) -> None:
    """A row that ends at end-of-text keeps the token in ``tokens`` but not its marker in
    ``text`` (before: a literal ``<|endoftext|>``; the server never sent it either)."""
    from types import SimpleNamespace

    from dipaco.cli.infer_generate import _InOrder
    from dipaco.inference import Generation

    run = InferenceRun.open(finished[0], need_weights=False)
    tok = run.tokenizer
    gen = Generation(prompt=[1], tokens=tok.encode("x = 1") + [tok.eos_id], window_paths=[0], switches=[(1, 0)],
                     stopped_at_eos=True, finish_reason="eos")
    rec = _InOrder(SimpleNamespace(tokenizer=tok), -1, 0, None).record(0, {}, gen, 0)
    assert rec["text"] == "x = 1" and rec["tokens"][-1] == tok.eos_id and "<|endoftext|>" in tok.decode(gen.tokens)


@pytest.mark.multiprocess  # the --file run is a subprocess killed mid-write
def test_a_killed_run_leaves_whole_lines_and_resume_finishes_it(finished, tmp_path, capsys, monkeypatch) -> None:
    run_dir = finished[0]
    texts = [t + str(k) for k in range(6) for t in TEXTS]  # 48 prompts
    prompts = _jsonl(tmp_path / "p.jsonl", texts)
    args = ["generate", str(run_dir), "--file", str(prompts), "--max-new-tokens", "24", "--temperature", "0",
            "--ignore-eos", "--batch-size", "2"]
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", "from dipaco.cli.infer import main; main()", *args,
                             "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600  # start-up is slow on a loaded host; bounded either way
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.stat().st_size > 0:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    data = out.read_bytes() if out.exists() else b""
    assert not data or data.endswith(b"\n"), "a killed run left a torn line"
    written = _lines(out) if data else []
    assert [x["index"] for x in written] == list(range(len(written)))
    with open(out, "ab") as f:
        f.write(b'{"index": ')  # a line torn mid-write (a kill inside write) is cut off by --resume
    code, err = run_cli(main, [*args, "--out", out, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    resumed = _lines(out)
    assert [x["index"] for x in resumed] == list(range(len(texts)))
    assert resumed[: len(written)] == written
    whole = tmp_path / "whole.jsonl"
    code, err = run_cli(main, [*args, "--out", whole], capsys, monkeypatch)
    assert code == 0, err
    assert _lines(whole) == resumed  # greedy: the same lines as one uninterrupted run


@pytest.mark.parametrize("extra, words", [
    (["--resume"], "--resume needs --out"),
    (["--top-p", "0"], "--top-p"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_bad_file_arguments_are_one_line(finished, tmp_path, capsys, monkeypatch, extra, words) -> None:
    prompts = _jsonl(tmp_path / "p.jsonl", TEXTS[:2])
    code, err = run_cli(main, ["generate", finished[0], "--file", prompts, *extra], capsys, monkeypatch)
    assert code != 0
    one_line(err, words)


def test_out_is_never_overwritten_and_resume_refuses_a_foreign_file(finished, tmp_path, capsys, monkeypatch) -> None:
    prompts = _jsonl(tmp_path / "p.jsonl", TEXTS[:2])
    out = tmp_path / "out.jsonl"
    out.write_text('{"ppl": 3.0}\n')
    base = ["generate", finished[0], "--file", prompts, "--out", out]
    code, err = run_cli(main, base, capsys, monkeypatch)
    assert code != 0
    one_line(err, "exists (not a file dipaco wrote)", "never overwritten")  # --resume would not help
    code, err = run_cli(main, [*base, "--resume"], capsys, monkeypatch)
    assert code != 0
    one_line(err, "not line 0 of an earlier")
    assert out.read_text() == '{"ppl": 3.0}\n'
    bad_seed = tmp_path / "s.jsonl"
    bad_seed.write_text(json.dumps({"text": "x", "seed": -1}) + "\n")
    code, err = run_cli(main, ["generate", finished[0], "--file", bad_seed], capsys, monkeypatch)
    assert code != 0
    one_line(err, "seed")
    code, err = run_cli(main, ["generate", finished[0], "--prompt", "x", "--out", out], capsys, monkeypatch)
    assert code != 0
    one_line(err, "--out goes with --file")
    code, err = run_cli(main, ["generate", finished[0], "--prompt", "x", "--fast"], capsys, monkeypatch)
    assert code != 0
    one_line(err, "--fast goes with --file")


@pytest.mark.parametrize("change, words", [
    (["--max-new-tokens", "3"], "--max-new-tokens 2"),
    (["--temperature", "0.5"], "--temperature 0.0"),
    (["--fast"], "--fast False"),
    ("prompts", "another prompts file"),
    ("no record", "no record of the job"),
])
def test_resume_continues_only_the_same_job(finished, tmp_path, capsys, monkeypatch, change, words) -> None:
    """Lines made with other settings, from other prompts or by an unknown job are never
    continued (found by a probe: --resume with other prompts and settings appended to them
    silently); the refusal touches nothing, a torn last line included."""
    prompts = _jsonl(tmp_path / "p.jsonl", TEXTS[:3])
    out = tmp_path / "out.jsonl"
    base = ["generate", finished[0], "--out", out, "--max-new-tokens", "2", "--temperature", "0"]
    code, err = run_cli(main, [*base, "--file", _jsonl(tmp_path / "first.jsonl", TEXTS[:2])], capsys, monkeypatch)
    assert code == 0, err
    (tmp_path / "first.jsonl").replace(prompts)  # the same bytes under the name the resume uses
    with open(out, "ab") as f:
        f.write(b'{"index": ')  # torn
    before = out.read_bytes()
    again = [*base, "--file", prompts, "--resume"]
    if change == "prompts":
        _jsonl(prompts, TEXTS[1:4])
    elif change == "no record":
        (tmp_path / "out.jsonl.job.json").unlink()
    else:
        again += change
    code, err = run_cli(main, again, capsys, monkeypatch)
    assert code != 0
    one_line(err, words)
    assert out.read_bytes() == before
    if change == "no record":
        return
    _jsonl(prompts, TEXTS[:2])  # the job as it was: continued
    code, err = run_cli(main, [*base, "--file", prompts, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert [x["index"] for x in _lines(out)] == [0, 1]
