"""Rules 1 and 2 (docs/reliability.md) in the processes that live long and read lazily:
a module file is checked against its manifest each time it is read, so one damaged after
a server (or a ``generate --file`` job) opened the run fails only the paths that read it;
and the files a reader will read are held (open descriptors), so a checkpoint pruned or
replaced by a run that goes on training is still read as it was.

Uses the shared tiny finished run (tests/_hostile.py's ``finished``: grid [2, 2]), copied.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _hostile import copy_run, run_cli
from dipaco.cli.infer import main
from dipaco.inference import InferenceRun, Request, RoutedEngine
from dipaco.run.checkpoint import CheckpointError

TEXTS = [f"def f{i}(x):\n    return x * {i}\n" + "import os\n" * (i % 3) + "class A:\n" * (i % 2) for i in range(12)] + [
    f"The river {i} ran past the old mill, and the miller's daughter counted the boats." * (1 + i % 2)
    for i in range(12)]


def _module_some_prompts_read(inf: InferenceRun, ids: list[list[int]]) -> tuple[str, set[int]]:
    """A module read by the path of some of ``ids`` and not by another's, and the paths reading it."""
    grid = inf.new_grid()
    routed = {inf.route(x) for x in ids}
    for mid in grid.module_ids:
        reads = {p for p in range(inf.num_paths) if mid in grid.module_ids_of_path(p)}
        if routed & reads and routed - reads:
            return mid, reads
    raise AssertionError(f"the prompts reach paths {routed} only: no module tells them apart")


def _damage(inf: InferenceRun, module_id: str) -> Path:
    f = inf.checkpoint / "modules" / f"{module_id}.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))  # in place, as a disk error or a careless copy would
    return f


def _opened(finished, tmp_path: Path, verify: str) -> InferenceRun:
    return InferenceRun.open(copy_run(finished[0], tmp_path / "run"), verify=verify)


@pytest.mark.parametrize("verify", ["all", "read"])
def test_a_module_damaged_after_open_fails_only_the_paths_that_read_it(finished, tmp_path, verify) -> None:
    """`dipaco-serve` / `--fast-verify` (verify=read) or not: the engine finishes the rows of
    the paths reading the damaged file with `error: ... does not match its manifest hash`;
    every other row is generated and the engine goes on."""
    inf = _opened(finished, tmp_path, verify)
    module, reads = _module_some_prompts_read(inf, [inf.encode(t) for t in TEXTS])
    bad = _damage(inf, module)
    engine = RoutedEngine(inf, max_batch_size=4)
    gens = engine.generate([Request(inf.encode(t), max_new_tokens=3, temperature=0.0) for t in TEXTS])
    paths = [g.window_paths[0] for g in gens]
    assert reads & set(paths) and set(paths) - reads, "the prompts must reach both kinds of path"
    for g, p in zip(gens, paths):
        if p in reads:
            assert g.finish_reason.startswith("error: ") and str(bad) in g.finish_reason
            assert "does not match its manifest hash" in g.finish_reason
        else:
            assert g.finish_reason in ("eos", "length") and g.tokens
    later = engine.generate([Request(inf.encode(TEXTS[paths.index(next(iter(set(paths) - reads)))]),
                                     max_new_tokens=2, temperature=0.0)])
    assert later[0].tokens  # the engine is alive


def test_generate_file_writes_every_line_and_fails_only_those_of_the_damaged_paths(finished, tmp_path, capsys,
                                                                                    monkeypatch) -> None:
    """`dipaco-infer generate --file P --out O` while a module file gets damaged (after the
    checkpoint was verified at open) — exit 1, one line naming the file; O holds every
    prompt's line, the failed ones with `"error"`, the others whole."""
    import dipaco.inference.run as run_module

    real_open = run_module.InferenceRun.open

    def open_then_damage(*a, **kw):
        inf = real_open(*a, **kw)
        said.append(_damage(inf, _module_some_prompts_read(inf, [inf.encode(t) for t in TEXTS])[0]).name)
        return inf

    said: list[str] = []

    monkeypatch.setattr(run_module.InferenceRun, "open", open_then_damage)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    run_dir = copy_run(finished[0], tmp_path / "run")
    out = tmp_path / "out.jsonl"
    code, err = run_cli(main, ["generate", run_dir, "--file", prompts, "--out", out, "--max-new-tokens", "2",
                               "--temperature", "0"], capsys, monkeypatch)
    assert code == 1
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert "prompt(s) failed" in last and said[0] in last and "Traceback" not in err
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == list(range(len(TEXTS)))
    failed = [x for x in lines if "error" in x]
    assert failed and len(failed) < len(lines) and all(x["finish_reason"] == "error" for x in failed)


def test_a_checkpoint_pruned_while_held_is_still_read_as_it_was(finished, tmp_path) -> None:
    """Rule 2: the training run goes on and prunes (keep_last) the checkpoint a server
    opened; the server's lazily loaded paths still come from the files it opened."""
    inf = _opened(finished, tmp_path, "read")
    loader = inf.loader(cache_size=1)
    before = {p: [t.clone() for t in loader.get(p).parameters()] for p in (0,)}
    shutil.rmtree(inf.checkpoint)  # what CheckpointManager.prune does to an old round
    for p in range(inf.num_paths):
        model = loader.get(p)
        if p in before:
            assert all((a == b).all() for a, b in zip(before[p], model.parameters()))
    inf.close()


def test_a_server_answers_500_for_a_damaged_path_and_goes_on(finished, tmp_path) -> None:
    """`dipaco-serve --fast-verify` (the server's engine over a run whose module file is
    damaged after start-up): a request routed to a path reading it is a 500 naming the file
    (code checkpoint_error); a request for another path is answered, and /health says the
    engine is up."""
    httpx = pytest.importorskip("httpx")
    from _serve_fakes import serving

    inf = _opened(finished, tmp_path, "read")
    module, reads = _module_some_prompts_read(inf, [[b + 1 for b in t.encode("utf-8")] for t in TEXTS])
    _damage(inf, module)
    engine = RoutedEngine(inf, max_batch_size=4)
    engine.num_paths = inf.num_paths
    with serving(engine) as (url, _service), httpx.Client(base_url=url, timeout=60) as client:
        seen = set()
        for t in TEXTS:
            r = client.post("/v1/completions", json={"model": "tiny-run", "prompt": t, "max_tokens": 2,
                                                     "temperature": 0})
            ids = [b + 1 for b in t.encode("utf-8")]
            path = inf.route(ids)
            if path in reads:
                assert r.status_code == 500 and "does not match its manifest hash" in r.text, r.text
                assert r.json()["error"]["code"] == "checkpoint_error"
            else:
                assert r.status_code == 200, r.text
            seen.add(path in reads)
            if seen == {True, False}:
                break
        assert seen == {True, False}
        health = client.get("/health").json()
        assert "down" not in json.dumps(health).lower() or health.get("status") == "ok", health


def test_a_damaged_module_read_directly_names_the_file(finished, tmp_path) -> None:
    inf = _opened(finished, tmp_path, "read")
    bad = _damage(inf, "embed")
    with pytest.raises(CheckpointError, match=str(bad.name)):
        inf.loader().get(0)


def test_a_token_file_rewritten_in_place_is_refused_where_read(tmp_path) -> None:
    """Rule 1 for token caches: tokens.bin rewritten in place to the same length (two ids
    swapped: the offsets and sizes still agree) is refused by every reader, naming it; an
    entry without its checksum cannot be checked, so a cache rebuilds it."""
    from router.tokens import TokenFileError, open_token_docs, write_token_docs

    write_token_docs(tmp_path / "t", [[1, 2, 3], [4, 5]])
    f = tmp_path / "t" / "tokens.bin"
    data = bytearray(f.read_bytes())
    data[0:4], data[4:8] = data[4:8], data[0:4]
    f.write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match=r"tokens\.bin: its sha256 is not the one written with it"):
        open_token_docs(tmp_path / "t")
    (tmp_path / "t" / "tokens.sha256").unlink()
    with pytest.raises(TokenFileError, match="cannot be checked"):
        open_token_docs(tmp_path / "t")
    assert list(open_token_docs(tmp_path / "t", require_checksum=False)[0]) == [2, 1, 3]


def test_score_reads_the_runs_own_splits_or_refuses_a_corpus_changed_since(finished, tmp_path, capsys,
                                                                           monkeypatch) -> None:
    """Rule 3: `dipaco-infer score D --validation` scores the documents D was evaluated on:
    its own recorded token splits (no corpus read: the data may be gone); where it must read
    the corpus again, one whose texts differ from the record (edited, or the built-in
    corpus's packages upgraded) is refused naming it, D byte-identical."""
    import dipaco.job.prepare as prepare
    from _hostile import snapshot

    run_dir = copy_run(finished[0], tmp_path / "run")
    real = prepare.load_corpus
    monkeypatch.setattr(prepare, "load_corpus", lambda *a, **k: pytest.fail("the corpus was read"))
    code, err = run_cli(main, ["score", run_dir, "--validation"], capsys, monkeypatch)
    assert code == 0, err
    monkeypatch.setattr(prepare, "load_corpus", real)
    fp = run_dir / "fingerprints.json"
    rec = json.loads(fp.read_text())
    rec.pop("tokens")
    rec["tokenizer"]["data"] = "0" * 64 + ":" + "0" * 64  # as if the corpus had changed since
    fp.write_text(json.dumps(rec))
    before = snapshot(run_dir)
    code, err = run_cli(main, ["score", run_dir, "--validation"], capsys, monkeypatch)
    assert code == 2 and "is not the corpus" in err and "Traceback" not in err, err
    assert snapshot(run_dir) == before
