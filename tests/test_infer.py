"""dipaco-infer and dipaco.inference: routing, routed generation, scoring, export, bad input.

One tiny [2, 2] run is trained once per session (a few seconds); the end-to-end tests
are marked ``slow``. CLI calls go through ``main([...])`` in-process (stderr captured),
plus one real subprocess to pin the exit code and the absence of a traceback.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.cli.infer import main, read_jsonl
from dipaco.inference import InferenceRun, load_exported_path, parse_path
from modules import ModuleGrid, ModelConfig

PROMPT = ("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='tool')\n"
          "    parser.add_argument('--verbose', action='store_true')\n")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A finished tiny run: grid [2, 2], one round, no dense baseline."""
    from hydra import compose, initialize_config_module

    from dipaco.config import register_configs, to_config
    from dipaco.job.train import train

    register_configs()
    with initialize_config_module(config_module="dipaco.conf", version_base="1.3"):
        c = compose("config", overrides=[
            "experiment=smoke", "launcher=local", "grid.levels=[2,2]", "trainer.rounds=1",
            "trainer.dense_baseline=false", "trainer.plots=false", "trainer.progress=false",
            "data.max_documents=160",
            # re-route on the 16 tokens before each window (the smoke prefix): a prompt of
            # this size then changes path, which the generation tests need to see
            "router.reroute_context=16"])
    cfg = to_config(c)
    cfg.run_dir = str(tmp_path_factory.mktemp("infer") / "run")
    train(cfg)
    return Path(cfg.run_dir)


@pytest.fixture(scope="session")
def corpus_texts(trained_run):
    """The run's training and validation texts, as the trainer split them."""
    from dipaco.data import load_corpus

    cfg = InferenceRun.open(trained_run, need_weights=False).cfg
    corpus = load_corpus(cfg.data, progress=False)
    from dipaco.job.prepare import evaluated_rows

    texts = corpus.split("validation")["text"]
    val = [texts[i] for i in evaluated_rows(len(texts), cfg.trainer.eval_max_documents)]
    return list(corpus.split("train")["text"]), val


def _copy_run(src: Path, dst: Path) -> Path:
    """A copy of the run without its (large, unneeded) caches."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("cache", "shards"))
    return dst


def _write_jsonl(path: Path, texts: list[str], extra_lines: tuple[str, ...] = ()) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``dipaco-infer`` in-process; return (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dipaco: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _reference_model(run_dir: Path, path_id: int):
    """The path assembled the trainer's way: every module loaded (independent of PathLoader)."""
    from dipaco.job.evaluation import load_grid_from_checkpoint
    from modules import PathModel

    run = InferenceRun.open(run_dir, device="cpu")  # the tests feed it CPU tensors, on a GPU host too
    grid = load_grid_from_checkpoint(run.cfg, run.checkpoint)
    return PathModel(grid, path_id).eval()


# --------------------------------------------------------------------------- no run needed


def test_read_jsonl_skips_and_counts_bad_lines(tmp_path, capsys):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "a"}\nnot json\n{"body": "x"}\n{"text": 3}\n\xff\xfe\n\n[1]\n{"text": "b"}\n')
    texts, skipped = read_jsonl(str(f), "text")
    assert texts == ["a", "b"] and skipped == 5
    err = capsys.readouterr().err
    assert "skipped 5 line(s)" in err
    assert "malformed_json=2, missing_text_field=1, non_utf8=1, not_a_string=1" in err


def test_read_jsonl_follows_the_training_readers_rules(tmp_path, capsys):
    """The same rules as training's readers: a BOM is no bad line, a deep nest or a lone
    surrogate costs its line only, and a FIFO is refused in one line without blocking."""
    import codecs
    import os
    import time

    f = tmp_path / "d.jsonl"
    f.write_bytes(codecs.BOM_UTF8 + b'{"text": "first"}\n' + b"[" * 100_000 + b"]" * 100_000
                  + b'\n{"text": "\\ud800"}\n{"text": "last"}\n')
    texts, skipped = read_jsonl(str(f), "text")
    assert texts == ["first", "last"] and skipped == 2
    assert "nested_too_deep=1, non_utf8=1" in capsys.readouterr().err
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    t = time.time()
    with pytest.raises(SystemExit):
        read_jsonl(str(fifo), "text")
    assert time.time() - t < 10 and "is not a regular file" in capsys.readouterr().err


def test_read_jsonl_without_usable_document_is_one_line(tmp_path, capsys):
    f = _write_jsonl(tmp_path / "d.jsonl", [], ("oops",))
    with pytest.raises(SystemExit) as e:
        read_jsonl(str(f), "body")
    _one_line_error(e.value.code, capsys.readouterr().err.splitlines()[-1], "body")


def test_parse_path_accepts_ids_and_tuples():
    grid = ModuleGrid(ModelConfig(vocab_size=16, d_model=8), [2, 3])
    assert parse_path("4", grid) == 4
    assert parse_path("1,2", grid) == grid.path_id_of((1, 2)) == 5
    assert parse_path("(0, 1)", grid) == 1
    for bad in ("6", "-1", "2,0", "x", "1,1,1", ""):
        with pytest.raises(ValueError, match="not a path of grid"):
            parse_path(bad, grid)


def test_bad_flag_and_missing_run_dir_are_one_line(tmp_path, capsys):
    _one_line_error(*_cli(capsys, "generate", tmp_path, "--prompt", "x", "--max-new-tokens", "0")[::2],
                    "--max-new-tokens")
    _one_line_error(*_cli(capsys, "frobnicate")[::2], "invalid choice")
    _one_line_error(*_cli(capsys, "generate", tmp_path / "nope", "--prompt", "hello")[::2],
                    "does not exist")
    _one_line_error(*_cli(capsys, "route", tmp_path / "nope", "--text", "hello")[::2], "does not exist")


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_route_agrees_with_router_on_training_documents(trained_run, corpus_texts, tmp_path, capsys):
    from dipaco.data import tokenize_dataset
    import datasets

    train_texts = corpus_texts[0][:60]
    run = InferenceRun.open(trained_run, need_weights=False)
    # the training pipeline's own tokenization, not the CLI's
    ids = tokenize_dataset(datasets.Dataset.from_dict({"text": train_texts}), run.tokenizer,
                           progress=False)["input_ids"]
    expected = run.router.route_batch([np.asarray(x) for x in ids])
    f = _write_jsonl(tmp_path / "train.jsonl", train_texts)
    code, out, _ = _cli(capsys, "route", trained_run, "--file", f, "--top-k", "3")
    assert code == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["path_id"] for r in recs] == expected.tolist()
    assert len(set(expected.tolist())) > 1  # the comparison would be weak with one path
    cand, costs = run.router.route_topk([np.asarray(x) for x in ids], 3)
    for r, c, k in zip(recs, cand, costs):
        assert [x["path_id"] for x in r["candidates"]] == c.tolist()
        assert np.allclose([x["cost"] for x in r["candidates"]], k)
        assert r["modules"] == run.new_grid().module_ids_of_path(r["path_id"])
        assert tuple(r["path"]) == run.router.path_tuple(r["path_id"])


@pytest.mark.slow
def test_score_equals_trainer_routed_evaluation(trained_run, corpus_texts, tmp_path, capsys):
    f = _write_jsonl(tmp_path / "val.jsonl", corpus_texts[1], ("{broken",))
    out = tmp_path / "score.json"
    code, _, err = _cli(capsys, "score", trained_run, "--file", f, "--out", out)
    assert code == 0, err
    report = json.loads(out.read_text())
    summary = json.loads((trained_run / "summary.json").read_text())
    assert report["num_tokens"] == summary["eval_tokens"] > 0
    assert np.isclose(report["ppl"], summary["routed_ppl"], rtol=1e-9)
    assert set(report["per_path"]) == set(summary["per_path"])
    for p, rec in summary["per_path"].items():
        assert np.isclose(report["per_path"][p]["ppl"], rec["ppl"], rtol=1e-9)
    assert report["skipped_malformed_lines"] == 1
    # re-routed scoring runs and counts the same tokens
    code, stdout, _ = _cli(capsys, "score", trained_run, "--file", f, "--reroute-every", "8", "--batch-size", "3")
    assert code == 0 and json.loads(stdout)["num_tokens"] == summary["eval_tokens"]
    # --validation: the run's own validation split, without exporting it first
    code, stdout, err = _cli(capsys, "score", trained_run, "--validation")
    assert code == 0, err
    assert np.isclose(json.loads(stdout)["ppl"], summary["routed_ppl"], rtol=1e-9)


@pytest.mark.slow  # trains its own run (it deletes the dense baseline)
def test_score_dense_and_split(tmp_path, capsys):
    """`score --dense` scores the run's saved dense baseline with the routed rule: on the
    run's own evaluation documents it gives summary.json's dense_ppl and ratio_vs_dense;
    `--split test` scores the test documents of a run evaluated on validation; a run
    without a baseline is one line naming the fix."""
    from dipaco.config import compose_config
    from dipaco.job.train import train

    cfg = compose_config(["experiment=smoke", "grid.levels=[2,1]", "trainer.rounds=1", "trainer.plots=false",
                          "trainer.progress=false", "data.max_documents=120"], tmp_path / "run")
    summary = train(cfg)
    capsys.readouterr()  # the training log
    code, stdout, err = _cli(capsys, "score", tmp_path / "run", "--validation", "--dense")
    assert code == 0, err
    report = json.loads(stdout)
    assert np.isclose(report["dense_ppl"], summary["dense_ppl"], rtol=1e-9)
    assert np.isclose(report["ratio_vs_dense"], summary["ratio_vs_dense"], rtol=1e-9)
    # --split test: the test documents the evaluation would pick, here with the same model
    code, stdout, err = _cli(capsys, "score", tmp_path / "run", "--split", "test", "--dense")
    assert code == 0, err
    on_test = json.loads(stdout)
    assert on_test["num_tokens"] > 0 and on_test["num_tokens"] != report["num_tokens"]
    code, stdout, _ = _cli(capsys, "score", tmp_path / "run", "--split", "validation")
    assert np.isclose(json.loads(stdout)["ppl"], summary["routed_ppl"], rtol=1e-9)
    # --long --dense: the first window and the later ones, each against dense on the same tokens
    code, stdout, err = _cli(capsys, "score", tmp_path / "run", "--validation", "--long", "--dense", "--seq-len", "24")
    assert code == 0, err
    parts = json.loads(stdout)["by_window"]
    for part in parts.values():
        assert np.isclose(part["ratio_vs_dense"], part["ppl"] / part["dense_ppl"])
    assert parts["later_windows"]["num_tokens"] > 0
    shutil.rmtree(tmp_path / "run" / "baseline")
    code, _, err = _cli(capsys, "score", tmp_path / "run", "--validation", "--dense")
    assert code != 0 and "no dense baseline" in err and "drop --dense" in err


@pytest.mark.slow
def test_greedy_generation_same_tokens_with_and_without_kv_cache(trained_run):
    run = InferenceRun.open(trained_run)
    prompt = run.encode(PROMPT * 4)[: run.cfg.model.max_seq_len - 8]  # crosses max_seq_len
    kw = dict(max_new_tokens=24, temperature=0.0, stop_at_eos=False, reroute_every=6)
    with_cache = run.generate(prompt, use_kv_cache=True, **kw)
    without = run.generate(prompt, use_kv_cache=False, **kw)
    assert len(with_cache.tokens) == 24
    assert with_cache.tokens == without.tokens
    assert with_cache.switches == without.switches


@pytest.mark.parametrize("context", ["3P", "all"])
def test_generation_reroutes_on_the_context_like_evaluation(trained_run, corpus_texts, context):
    """Generation re-routes each window on the router.reroute_context tokens before it (or
    everything read so far), exactly as Router.reroute_windows (evaluation)."""
    run = InferenceRun.open(trained_run, device="cpu")
    P = run.prefix_tokens
    run.router.reroute_context = 3 * P if context == "3P" else None  # as a router fitted with it
    W = 5
    train, _ = corpus_texts
    # a prompt that changes document every few windows; windows inside it are routed by the
    # same rule as generated ones (Generation.window_paths fills them in)
    prompt = [t for text in train[::7][:12] for t in run.encode(text)[:3 * W]][: run.cfg.model.max_seq_len - 4]
    gen = run.generate(prompt, max_new_tokens=3, temperature=0.0, reroute_every=W, stop_at_eos=False)
    seq = gen.sequence
    assert gen.window_paths == run.router.reroute_windows(np.asarray(seq), W)
    # the test can tell the two rules apart: windows routed on prefix_tokens differ somewhere
    prefix_rule = [run.route(seq[:P])] + [run.route(seq[max(0, j * W - P): j * W])
                                          for j in range(1, len(gen.window_paths))]
    assert prefix_rule != gen.window_paths, "both rules agree here; pick another prompt"


@pytest.mark.slow
def test_reroute_path_sequence_and_tokens_follow_the_window_rule(trained_run, capsys):
    run = InferenceRun.open(trained_run)
    W = 4
    code, out, err = _cli(capsys, "generate", trained_run, "--prompt", PROMPT, "--max-new-tokens", "40",
                          "--temperature", "0", "--reroute-every", W, "--ignore-eos", "--json",
                          "--device", "cpu")  # greedy ties must break as in the CPU reference below
    assert code == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    seq = rec["prompt_ids"] + rec["tokens"]
    assert len(rec["prompt_ids"]) >= run.prefix_tokens
    assert rec["path_sequence"] == run.router.reroute_windows(np.asarray(seq), W)
    assert len(set(rec["paths_used"])) > 1, "no re-routing happened; pick another prompt"
    # each generated token is the greedy choice of its window's path over the whole context
    # (an independent, fully loaded model: checks the rebuilt KV caches too)
    n = len(rec["prompt_ids"])
    refs = {p: _reference_model(trained_run, p) for p in set(rec["paths_used"])}
    with torch.no_grad():
        for j in range(n, len(seq)):
            p = rec["path_sequence"][j // W]
            logits = refs[p](torch.tensor([seq[:j]]))[0, -1]
            assert int(logits.argmax()) == seq[j], (j, p)


@pytest.mark.slow
def test_generate_builds_only_the_modules_of_its_path(trained_run):
    run = InferenceRun.open(trained_run)
    prompt = run.encode(PROMPT)
    loader = run.loader()
    run.generate(prompt, max_new_tokens=5, loader=loader)
    path = run.route(prompt)
    assert loader.loaded_paths == [path]
    assert loader.built_module_ids() == set(run.new_grid().module_ids_of_path(path))
    assert len(loader.built_module_ids()) < len(run.new_grid().module_ids)
    # re-routing: only the current path stays in memory
    gen = run.generate(prompt, max_new_tokens=40, temperature=0.0, reroute_every=4, stop_at_eos=False,
                       loader=loader)
    last = gen.switches[-1][1]
    assert loader.loaded_paths == [last]
    assert loader.built_module_ids() == set(run.new_grid().module_ids_of_path(last))


@pytest.mark.slow
def test_export_then_load_gives_the_same_logits(trained_run, tmp_path, capsys):
    run = InferenceRun.open(trained_run)
    path_id = run.num_paths - 1
    out = tmp_path / "exported"
    code, stdout, err = _cli(capsys, "export", trained_run, "--path", ",".join(map(str, run.router.path_tuple(path_id))),
                             "--out", out)
    assert code == 0, err
    assert json.loads(stdout)["path_id"] == path_id
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "tokenizer.json", "manifest.json",
                                           "provenance.json", ".dipaco-export", ".dipaco-owned.json"}
    model, tok = load_exported_path(out)
    assert model.path_id == path_id and tok.encode(PROMPT) == run.encode(PROMPT)
    assert set(model.grid.built_modules()) == set(run.new_grid().module_ids_of_path(path_id))
    x = torch.tensor([run.encode(PROMPT)])
    with torch.no_grad():
        assert torch.equal(model(x), _reference_model(trained_run, path_id)(x))
    # refusing to overwrite, and a tampered export
    _one_line_error(*_cli(capsys, "export", trained_run, "--path", path_id, "--out", out)[::2], "not empty")
    _one_line_error(*_cli(capsys, "export", trained_run, "--path", "9,9", "--out", tmp_path / "x")[::2],
                    "not a path")
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (out / "model.safetensors").write_bytes(bytes(data))
    from dipaco.run.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_exported_path(out)


@pytest.mark.slow
def test_bad_input_one_line_errors(trained_run, tmp_path, capsys):
    _one_line_error(*_cli(capsys, "generate", trained_run, "--prompt", "")[::2], "empty")
    _one_line_error(*_cli(capsys, "generate", trained_run, "--prompt", "   ")[::2], "empty")
    _one_line_error(*_cli(capsys, "score", trained_run, "--file", tmp_path / "missing.jsonl")[::2],
                    "missing.jsonl")
    # no checkpoint at all
    bare = _copy_run(trained_run, tmp_path / "bare")
    shutil.rmtree(bare / "checkpoints")
    _one_line_error(*_cli(capsys, "generate", bare, "--prompt", "x")[::2], "checkpoints")


@pytest.mark.slow
def test_short_prompt_routes_on_what_exists(trained_run, capsys):
    run = InferenceRun.open(trained_run)
    short = "def f"
    ids = run.encode(short)
    assert 0 < len(ids) < run.prefix_tokens
    code, out, err = _cli(capsys, "generate", trained_run, "--prompt", short, "--max-new-tokens", "3", "--json")
    assert code == 0, err
    assert "fewer than the routing prefix" in err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["paths_used"] == [run.router.route(np.asarray(ids))]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_corrupt_weights_file_is_refused_naming_it(trained_run, tmp_path, capsys):
    bad = _copy_run(trained_run, tmp_path / "corrupt")
    run = InferenceRun.open(bad)
    on_path = set(run.new_grid().module_ids_of_path(run.route(run.encode(PROMPT))))
    off_path = sorted(set(run.new_grid().module_ids) - on_path)[0]
    victim = run.checkpoint / "modules" / f"{off_path}.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: same size, different hash
    victim.write_bytes(bytes(data))
    # default: the whole checkpoint is checked, even a module the prompt does not use
    _one_line_error(*_cli(capsys, "generate", bad, "--prompt", PROMPT)[::2], victim.name, "hash")
    # --fast-verify checks only what it reads: the prompt's path is intact
    code, _, err = _cli(capsys, "generate", bad, "--prompt", PROMPT, "--max-new-tokens", "2", "--fast-verify")
    assert code == 0, err
    # ... but a command that reads the corrupt module refuses it
    _one_line_error(*_cli(capsys, "export", bad, "--path", off_path_path(run, off_path), "--out",
                          tmp_path / "e", "--fast-verify")[::2], victim.name)
    # a real process: exit code 2, one line, no traceback
    proc = subprocess.run([sys.executable, "-m", "dipaco.cli.infer", "score", str(bad), "--file",
                           str(_write_jsonl(tmp_path / "d.jsonl", [PROMPT]))],
                          capture_output=True, text=True, timeout=120)
    _one_line_error(proc.returncode, proc.stderr, victim.name)


def off_path_path(run: InferenceRun, module_id: str) -> str:
    """A path id whose modules include ``module_id``."""
    grid = run.new_grid()
    return str(next(p for p in range(grid.num_paths) if module_id in grid.module_ids_of_path(p)))
