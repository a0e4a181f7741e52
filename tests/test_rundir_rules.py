"""Run-directory integrity, by rule (docs/reliability.md, "Rules"): no command overwrites
what a run directory holds; every artefact is verified when read; the record of a run is
what ran; outputs never become inputs. Each rule lives in one place (dipaco/run/routed.py,
dipaco/run/fingerprint.py, dipaco/run/record.py, dipaco/run/outputs.py) and each test here
is a table over the commands, keys or readers it concerns.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


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
