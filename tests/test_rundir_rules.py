"""Run-directory integrity, by rule (docs/reliability.md, "Rules"): no command overwrites
what a run directory holds; every artefact is verified when read; the record of a run is
what ran; outputs never become inputs. Each rule lives in one place (dipaco/run/routed.py,
dipaco/run/fingerprint.py, dipaco/run/record.py, dipaco/run/outputs.py) and each test here
is a table over the commands, keys or readers it concerns.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from dipaco.cli import infer as infer_cli
from dipaco.cli import train as train_cli
from dipaco.config import ConfigError, compose_config
from dipaco.job.report import find_runs
from dipaco.run.record import hand_edits, write_run_config
from dipaco.run.resume import allowed_on_resume, flat_config, resume_config
from dipaco.run.run_dir import RunDir, RunDirError

from _hostile import SMOKE, copy_run, one_line, run_cli, snapshot

# what dipaco-route leaves: the run's config, its artefacts and their fingerprints
_TRAINING_OUTPUTS = ("checkpoints", "summary.json", "metrics.jsonl", "steps.jsonl", "tb", "baseline", "plots",
                     "train.log", "resumes.jsonl", "val_shards")


def routed_copy(finished: Path, dst: Path) -> Path:
    """A routed directory (as ``dipaco-route`` leaves one) cut from the shared finished run."""
    run = copy_run(finished, dst)
    for name in _TRAINING_OUTPUTS:
        p = run / name
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return run


# ------------------------------------------------------------------ no command overwrites what a run holds


@pytest.mark.slow
@pytest.mark.parametrize("args", [["seed=3"], ["grid=4x4"], ["data.max_documents=300"], ["model.vocab_size=1024"],
                                  ["router.prefix_tokens=8"], ["resume=true", "experiment=smoke", "seed=5"]],
                         ids=lambda a: " ".join(a))
def test_training_a_routed_directory_never_rebuilds_it(finished, tmp_path, capsys, monkeypatch, args):
    """`dipaco-route ... hydra.run.dir=D`, then `dipaco-train hydra.run.dir=D KEY=VALUE` where KEY is one that D's tokenizer, router or shards were made from (seed, grid, data, vocabulary, replicas, router, an experiment overlay; with or without `resume=true`)
    — `config error: KEY: D holds artefacts made with KEY=saved (router, shards, tokenizer); training on it continues from them and cannot use VALUE. Fix: drop KEY=... (the directory's own config.yaml is used), or route again into another hydra.run.dir`; exit 2; D byte-identical (it used to be rebuilt with the default config)."""
    run = routed_copy(finished[0], tmp_path / "D")
    before = snapshot(run)
    code, err = run_cli(train_cli.main, [f"hydra.run.dir={run}", *args], capsys, monkeypatch)
    assert code == 2, err
    one_line(err, "holds artefacts made with", "route again")
    assert snapshot(run) == before


@pytest.mark.slow
def test_training_a_routed_directory_continues_from_what_it_holds(finished, tmp_path, capsys, monkeypatch):
    """`dipaco-train hydra.run.dir=D trainer.stop_after_rounds=1` on a routed D (the way `dipaco-route --help` says)
    — trains from D's own config.yaml and artefacts: `tokenizer.json`, `router/`, `shards/`, `routing_report.json`, `.hydra/` byte-identical, the allowed change recorded (`resumes.jsonl`), round 1's checkpoint written."""
    run = routed_copy(finished[0], tmp_path / "D")
    kept = {k: v for k, v in snapshot(run).items()
            if k.split("/")[0] in ("tokenizer.json", "router", "shards", "routing_report.json", ".hydra")}
    code, err = run_cli(train_cli.main, [f"hydra.run.dir={run}", "trainer.stop_after_rounds=1"], capsys, monkeypatch)
    assert code == 0, err[-2000:]
    after = snapshot(run)
    assert {k: after.get(k) for k in kept} == kept
    assert (run / "checkpoints" / "round_000001").is_dir()
    assert "trainer.stop_after_rounds" in (run / "resumes.jsonl").read_text()


def test_artefacts_without_their_fingerprints_are_refused_by_every_command(finished, tmp_path, capsys, monkeypatch):
    """`fingerprints.json` deleted from a run (a finished run, a routed directory), then every command that reads it: `resume=true`, a plain `dipaco-train hydra.run.dir=D`, `dipaco-infer route/generate/score/export`
    — `D holds tokenizer.json, router/, ... but no fingerprints.json: what they were made from cannot be checked, so they are not used` (or the same for the config record); exit 2; D byte-identical. A missing record is never a pass."""
    finished_run = copy_run(finished[0], tmp_path / "F")
    routed = routed_copy(finished[0], tmp_path / "R")
    for run in (finished_run, routed):
        (run / "fingerprints.json").unlink()
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    commands = [(train_cli.main, [f"hydra.run.dir={finished_run}", "resume=true"]),
                (train_cli.main, [f"hydra.run.dir={routed}"]),
                (train_cli.main, [f"hydra.run.dir={routed}", "resume=true"]),
                (infer_cli.main, ["route", finished_run, "--text", "def f(x): return x"]),
                (infer_cli.main, ["generate", finished_run, "--prompt", "def", "--max-new-tokens", "2"]),
                (infer_cli.main, ["score", finished_run, "--file", docs]),
                (infer_cli.main, ["export", finished_run, "--path", "0", "--out", tmp_path / "exp"])]
    before = snapshot(tmp_path)
    for main, argv in commands:
        code, err = run_cli(main, argv, capsys, monkeypatch)
        assert code == 2, (argv, err[-2000:])
        one_line(err, "fingerprints.json")
    assert snapshot(tmp_path) == before


def test_an_artefact_without_its_recorded_hash_is_refused(finished, tmp_path, capsys, monkeypatch):
    """A run whose `fingerprints.json` lost its `outputs` record (the sha256 of each artefact), and whose `tokenizer.json` was then replaced
    — inference recomputes the tokenizer's hash from the router's record and refuses it (`... is not the tokenizer this run was made with`); a resume refuses `shards/shards.json: fingerprints.json records no sha256 for it, so it cannot be checked ...`; exit 2; byte-identical."""
    run = copy_run(finished[0], tmp_path / "run")
    fps = json.loads((run / "fingerprints.json").read_text())
    del fps["outputs"]
    (run / "fingerprints.json").write_text(json.dumps(fps))
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    for main, argv, needle in ((train_cli.main, [f"hydra.run.dir={run}", "resume=true", "trainer.rounds=3"],
                                "records no sha256"),
                               (infer_cli.main, ["score", run, "--file", docs], "is not the tokenizer")):
        if main is infer_cli.main:
            (run / "tokenizer.json").write_text((run / "tokenizer.json").read_text() + "\n")
        before = snapshot(run)
        code, err = run_cli(main, argv, capsys, monkeypatch)
        assert code == 2, err[-2000:]
        one_line(err, needle)
        assert snapshot(run) == before


# ------------------------------------------------------------------ the record of a run is what ran


def _other_value(v: Any) -> list[Any]:
    """Values unlike ``v`` of its kind, to write into config.yaml by hand."""
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [v + 1]
    if isinstance(v, float):
        return [v * 2 + 1]
    if isinstance(v, str):
        return [v + "x"]
    if isinstance(v, list):
        return [v + v[-1:] if v else [1]]
    return [1, "x"]  # null: whichever the key's type takes


def _saved_run(tmp_path: Path) -> RunDir:
    run = RunDir.at(tmp_path / "run")
    run.root.mkdir()
    write_run_config(run, compose_config(SMOKE, run.root))
    return run


def _edit_by_hand(run: RunDir, keys: list[str]) -> list[str]:
    """Write another value of each of ``keys`` (one its type takes) into ``config.yaml``;
    the keys edited."""
    doc = OmegaConf.structured(run.load_config())  # typed: a value the key cannot hold is rejected here
    edited = []
    for key in keys:
        for other in _other_value(OmegaConf.select(doc, key)):
            try:
                OmegaConf.update(doc, key, other, merge=False)
            except Exception:
                continue
            edited.append(key)
            break
    run.config.write_text(OmegaConf.to_yaml(doc))
    return edited



def test_a_key_a_newer_schema_added_is_no_hand_edit(tmp_path):
    """A run recorded by a dipaco whose schema lacked some keys (the `cluster` group, added
    since): its config.yaml now reads them at their defaults, nobody edited them, and a
    resume must not be refused for them; a recorded key edited by hand still is seen."""
    run = _saved_run(tmp_path)
    fps = run.root / "fingerprints.json"
    record = json.loads(fps.read_text())
    record["config"] = {k: v for k, v in record["config"].items() if not k.startswith("cluster.")}
    fps.write_text(json.dumps(record))
    assert hand_edits(run, run.load_config()) == {}
    doc = OmegaConf.load(run.config)
    doc.trainer.lr = float(doc.trainer.lr) * 2
    run.config.write_text(OmegaConf.to_yaml(doc))
    assert list(hand_edits(run, run.load_config())) == ["trainer.lr"]

@pytest.mark.slow
def test_every_key_edited_by_hand_in_config_yaml_is_honoured_as_recorded_or_refused(tmp_path):
    """`config.yaml` of a run edited by hand before `resume=true`, every key of the config (`trainer.precision`, the evaluation keys, the grid, the launcher, ...)
    — a key a resume may change is honoured and recorded as a change of the resume (`resumes.jsonl`: ran with → edited); any other is `config error: KEY: D/config.yaml says KEY=edited but the run ran with saved (fingerprints.json): it was edited by hand ... Fix: put KEY: saved back in config.yaml, ...`. No edit is used silently."""
    run = _saved_run(tmp_path)
    original = run.config.read_text()
    keys = [k for k in flat_config(run.load_config()) if k not in ("resume", "run_dir")]
    given = compose_config(["resume=true"], run.root)
    # every key: the edit is seen
    edited = _edit_by_hand(run, keys)
    assert len(edited) > 0.9 * len(keys)
    assert sorted(hand_edits(run, run.load_config())) == sorted(edited)
    # a resume may change these: all honoured, each recorded as a change
    run.config.write_text(original)
    allowed = _edit_by_hand(run, [k for k in keys if allowed_on_resume(k)])
    _, changes = resume_config(given, run, ["resume=true"])
    assert set(allowed) <= set(changes)
    # any other: refused, naming it
    for key in [k for k in edited if not allowed_on_resume(k)][::8] + ["trainer.precision", "trainer.eval_split"]:
        run.config.write_text(original)
        assert _edit_by_hand(run, [key]) == [key]
        with pytest.raises(ConfigError, match="edited by hand") as err:
            resume_config(given, run, ["resume=true"])
        assert err.value.key == key


def test_stop_after_rounds_on_resume_is_kept_when_it_equals_the_first_launchs(tmp_path):
    """`resume=true trainer.stop_after_rounds=1` on a run first launched with `trainer.stop_after_rounds=1`
    — the resume stops after round 1 as asked (the equal value used to be dropped, so the resume ran to the end); without the key a resume goes on to the end."""
    run = RunDir.at(tmp_path / "run")
    run.root.mkdir()
    write_run_config(run, compose_config(SMOKE + ["trainer.stop_after_rounds=1"], run.root))
    asked = ["resume=true", "trainer.stop_after_rounds=1"]
    cfg, _ = resume_config(compose_config(asked, run.root), run, asked)
    assert cfg.trainer.stop_after_rounds == 1
    cfg, _ = resume_config(compose_config(["resume=true"], run.root), run, ["resume=true"])
    assert cfg.trainer.stop_after_rounds is None


def test_dipaco_report_reads_what_ran(tmp_path):
    """`dipaco-report` over a run whose `.hydra/overrides.yaml` disagrees with its `config.yaml` (a refused command's overrides left behind)
    — every key is read from `config.yaml`, what ran; Hydra's record only names config-group choices."""
    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    write_run_config(RunDir.at(run), compose_config(SMOKE + ["seed=1"], run))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(["seed=7", "grid=4x4"])))
    (run / "summary.json").write_text(json.dumps({"routed_ppl": 1.0, "num_paths": 4}))
    (row,), _ = find_runs(tmp_path / "sweep")
    assert row.value("seed") == "1" and row.value("grid.levels") == "[2, 2]"


# ------------------------------------------------------------------ outputs never become inputs


def _plant_outputs(folder: Path) -> None:
    """Every kind of folder dipaco writes, inside a data folder, each with files a reader would take."""
    run = folder / "run1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("grid:\n  levels: [2, 2]\n")
    (run / "fingerprints.json").write_text("{}")
    (run / "notes.txt").write_text("a run's file")
    (run / "metrics.jsonl").write_text(json.dumps({"text": "round 1"}) + "\n")
    starting = folder / "run2"  # a run being written: config.yaml and Hydra's record only
    (starting / ".hydra").mkdir(parents=True)
    (starting / "config.yaml").write_text("seed: 0\n")
    (starting / "train.log").write_text("[dipaco] corpus: ...")
    export = folder / "exports" / "path0"
    export.mkdir(parents=True)
    (export / ".dipaco-export").write_text("dipaco-path v1\n")
    (export / "README.md").write_text("model card")
    (export / "meta.json").write_text(json.dumps({"text": "export"}))
    report = folder / "report"
    report.mkdir()
    (report / "report.md").write_text("| routed ppl |")
    (report / "report.json").write_text(json.dumps([{"text": "setting"}]))
    sweep = folder / "multirun" / "2026-01-01"
    (sweep / "0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "0" / "summary.json").write_text(json.dumps({"text": "summary"}))


@pytest.mark.parametrize("source", ["text", "jsonl", "json"])
@pytest.mark.parametrize("spelling", ["directory", "glob"])
def test_outputs_inside_a_data_folder_are_never_read_as_data(tmp_path, source, spelling):
    """A run directory (finished, or still being written), an export, a `dipaco-report` folder and a sweep folder inside the data folder of `data=text` / `jsonl` / `json`, named as a directory or a glob
    — every reader skips each folder whole (counted as `dipaco_output` in the skipped documents): only the data's own files are read; `data.path` naming such a folder is `data.path=D is a folder dipaco wrote ...: its files are outputs, not training data`."""
    from dipaco.data.errors import DataError
    from dipaco.data.files import resolve_files

    data = tmp_path / "corpus"
    (data / "sub").mkdir(parents=True)
    ext = {"text": ".txt", "jsonl": ".jsonl", "json": ".json"}[source]
    mine = [data / f"a{ext}", data / "sub" / f"b{ext}"]
    for f in mine:
        f.write_text(json.dumps({"text": "def f(x): return x"}) + "\n")
    _plant_outputs(data)
    skipped: dict = {}
    path = str(data) if spelling == "directory" else str(data / "**" / "*")
    files, _ = resolve_files(path, source, skipped)
    assert sorted(files) == sorted(map(str, mine)) and skipped["dipaco_output"] >= 4
    for out in ("run1", "exports/path0", "report", "multirun/2026-01-01"):
        with pytest.raises(DataError, match="a folder dipaco wrote"):
            resolve_files(str(data / out), source, {})


def test_a_runs_token_cache_inside_a_tokens_folder_is_not_a_shard(tmp_path):
    """`data=tokens data.path=D` where D holds token shards and a run directory (its `cache/` holds token entries of the same layout)
    — the run's entries are not shards: only D's own are read."""
    import numpy as np

    from dipaco.data.pretokenized import _token_shards

    for shard in ("train", "run/cache/tokens-abc"):
        d = tmp_path / shard
        d.mkdir(parents=True)
        np.asarray([1, 2, 3], dtype="<u2").tofile(d / "tokens.bin")
        np.save(d / "offsets.npy", np.asarray([0, 3]))
    (tmp_path / "run" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "run" / "fingerprints.json").write_text("{}")
    assert [name for name, _ in _token_shards(str(tmp_path))] == ["train"]


# ------------------------------------------------------------------ a damaged final checkpoint is repaired


def _damage(ckpt: Path, how: str) -> None:
    module = sorted((ckpt / "modules").glob("*.safetensors"))[0] if (ckpt / "modules").is_dir() else \
        sorted(p for p in ckpt.rglob("*.safetensors"))[0]
    if how == "flipped_byte":
        data = bytearray(module.read_bytes())
        data[len(data) // 2] ^= 0xFF
        module.write_bytes(bytes(data))
    elif how == "missing_file":
        module.unlink()
    else:
        (ckpt / "manifest.json").unlink()


@pytest.mark.slow
def test_a_damaged_final_checkpoint_is_repaired_from_the_previous_good_one(finished, tmp_path, capsys, monkeypatch):
    """`resume=true` on a finished run whose final checkpoint is damaged (a flipped byte, a missing file, no manifest)
    — not "nothing to do": `D is finished but its final checkpoint is damaged (...); repairing it from the newest checkpoint that verifies`; the last round is re-made from round 1's checkpoint, to the same weights and the same routed perplexity. The resume routes no document again (the shards its fingerprints vouch for are reused)."""
    import dipaco.job.prepare as prepare_module
    from dipaco.job.train import train

    def no_routing(*_a: Any, **_k: Any) -> None:
        raise AssertionError("a resume re-routed every document")

    monkeypatch.setattr(prepare_module, "assign_in_batches", no_routing)
    from dipaco.run.checkpoint import CheckpointManager
    from dipaco.run.resume import finished_summary

    for how in ("missing_file", "no_manifest"):
        run = copy_run(finished[0], tmp_path / how)
        _damage(run / "checkpoints" / "round_000002", how)
        assert finished_summary(compose_config(SMOKE, run), RunDir.at(run)) is None
    run = copy_run(finished[0], tmp_path / "run")
    good = snapshot(run / "checkpoints" / "round_000002")
    _damage(run / "checkpoints" / "round_000002", "flipped_byte")
    summary = train(compose_config(["resume=true"], run), overrides=["resume=true"])
    assert "final checkpoint is damaged" in capsys.readouterr().out
    CheckpointManager.verify(run / "checkpoints" / "round_000002")
    after = snapshot(run / "checkpoints" / "round_000002")
    assert {k: v for k, v in after.items() if k.endswith(".safetensors")} == \
        {k: v for k, v in good.items() if k.endswith(".safetensors")}
    assert summary["routed_ppl"] == pytest.approx(finished[1]["routed_ppl"], rel=1e-6)


# ------------------------------------------------------------------ a token store's id width is its header's


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32"])
@pytest.mark.parametrize("damage", ["none", "cut_to_half", "one_id_short", "no_header", "header_says_other"])
def test_a_token_stores_id_width_comes_from_its_header(tmp_path, dtype, damage):
    """`data=tokens` over a `tokens.bin` of uint16 / uint32 / int32 ids cut to half its size (a uint32 file then has exactly the size of uint16 ids), one id short, without its `tokens.json` header, or with a header naming another width
    — the width is read from `tokens.json`, never from size ÷ count: the intact store reads its own ids; each damage is one `DataError` line (`... holds N bytes for the M token ids offsets.npy counts as uint32 ...: it is truncated` / `... has no tokens.json naming the id type ...`)."""
    import numpy as np

    from dipaco.data.errors import DataError
    from dipaco.data.pretokenized import open_token_shard

    d = tmp_path / "tok"
    d.mkdir()
    ids = np.arange(1, 41, dtype=dtype)
    ids.tofile(d / "tokens.bin")
    np.save(d / "offsets.npy", np.asarray([0, 10, 40]))
    (d / "tokens.json").write_text(json.dumps({"dtype": dtype}))
    if damage == "cut_to_half":
        (d / "tokens.bin").write_bytes((d / "tokens.bin").read_bytes()[: ids.nbytes // 2])
    elif damage == "one_id_short":
        (d / "tokens.bin").write_bytes((d / "tokens.bin").read_bytes()[: -ids.itemsize])
    elif damage == "no_header":
        (d / "tokens.json").unlink()
    elif damage == "header_says_other":
        (d / "tokens.json").write_text(json.dumps({"dtype": "uint16" if dtype != "uint16" else "uint32"}))
    if damage == "none":
        assert [doc.tolist() for doc in open_token_shard(d)] == [list(range(1, 11)), list(range(11, 41))]
        return
    with pytest.raises(DataError) as err:
        open_token_shard(d)
    assert "\n" not in str(err.value) and ("tokens.json" in str(err.value) or "truncated" in str(err.value))
