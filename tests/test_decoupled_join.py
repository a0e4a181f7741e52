"""``dipaco-decoupled``, in-process: every bad input is one line and a non-zero exit, and a
refused join changes nothing in the store (its listing and bytes, before and after);
``status`` reads paths, leases, modules, synchronisers and hosts from the store alone."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from _hostile import SMOKE, one_line, run_cli, snapshot
from dipaco.config import compose_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.module_leases import write_module
from dipaco.decoupled.owner import FINISHED_KEY, PLAN_KEY, RUN_KEY, write_run_record
from dipaco.decoupled.service import progress_key
from dipaco.decoupled.store import FileStore
from dipaco.decoupled.supervisor import run_config_dict
from dipaco.fleet.cli import main

MODULES = ["embed", "L0.0", "L0.1", "head"]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """A run's config (as the store records it) and one with another seed."""
    cfg = compose_config(SMOKE + ["diloco.mode=decoupled"], "/runs/a")
    other = compose_config(SMOKE + ["diloco.mode=decoupled", "seed=7"], "/runs/a")
    return run_config_dict(cfg, cfg.diloco.decoupled), run_config_dict(other, other.diloco.decoupled)


def _run_store(root: Path, cfg_dict: dict, run_dir: Path) -> FileStore:
    st = FileStore(root)
    st.put_json(PLAN_KEY, {"rounds": 2, "inner_steps": 4, "num_paths": 2, "module_ids": MODULES,
                           "sharing": {"embed": [0, 1], "L0.0": [0], "L0.1": [1], "head": [0, 1]}, "levels": [2]})
    for m in MODULES:
        write_module(st, MergingModuleSync(m, torch.zeros(3), [0, 1], DecoupledConfig(), {"lr": 1.0}), 0)
    write_run_record(st, cfg_dict, run_dir)
    return st


def _cases(tmp: Path, cfg_dict: dict, other: dict) -> list[tuple[str, list[str], Path, str]]:
    """(what, argv, folder that must not change, words the line must hold)."""
    run_dir = tmp / "run"  # holds no prepared data
    run_dir.mkdir()
    good = tmp / "good"
    _run_store(good, cfg_dict, run_dir)
    a_file = tmp / "a_file"
    a_file.write_text("not a store")
    empty = tmp / "empty"
    empty.mkdir()
    other_files = tmp / "other"
    other_files.mkdir()
    (other_files / "notes.txt").write_text("mine")
    legacy = tmp / "legacy"
    FileStore(legacy).put_json(PLAN_KEY, {"rounds": 1})
    old = tmp / "old_dipaco"
    st = _run_store(old, cfg_dict, run_dir)
    st.put_json(RUN_KEY, {**st.get_json(RUN_KEY), "code": "0.0.9"})
    done = tmp / "finished"
    _run_store(done, cfg_dict, run_dir).put_json(FINISHED_KEY, {"checkpoint": "/runs/a/checkpoints/round_000002"})
    other_yaml = tmp / "other.yaml"
    other_yaml.write_text(OmegaConf.to_yaml(OmegaConf.create(other)))
    return [
        ("no such folder", ["worker", tmp / "missing"], tmp, "no such folder"),
        ("a file", ["sync", a_file], tmp, "not a folder"),
        ("an empty URL", ["status", ""], tmp, "the store URL is empty"),
        ("an empty folder", ["worker", empty], empty, "not the store of a dipaco run"),
        ("a folder of other files", ["status", other_files], other_files, "not the store of a dipaco run"),
        ("a store from before run records", ["sync", legacy], legacy, "before run records"),
        ("another dipaco", ["worker", old], old, "dipaco 0.0.9"),
        ("another config", ["sync", good, "--config", other_yaml], good, "seed: run has 0, yours 7"),
        ("a finished run", ["worker", done], done, "is finished"),
        ("a finished run, finish", ["finish", done, run_dir], done, "already finished"),
        ("unreachable", ["status", "nosuch://bucket/run"], tmp, "cannot reach the store"),
        ("one process's memory", ["sync", "memory://bucket/run"], tmp, "inside one process"),
        ("a run directory without the data", ["worker", good], good, "prepared data"),
        ("finish into a run directory without the data", ["finish", good, run_dir], good, "prepared data"),
        ("a bad count", ["worker", good, "--count", "0"], good, "--count"),
    ] + ([("a GPU this host lacks", ["worker", good, "--device", "cuda"], good, "no CUDA device")]
         if not torch.cuda.is_available() else [])


def test_every_bad_input_is_one_line_and_changes_nothing(made, tmp_path: Path, capsys, monkeypatch) -> None:
    cfg_dict, other = made
    for what, argv, folder, needle in _cases(tmp_path, cfg_dict, other):
        before = snapshot(folder)
        code, err = run_cli(main, argv, capsys, monkeypatch)
        assert code == 2, (what, code, err)
        one_line(err, "dipaco: error:", needle)
        assert snapshot(folder) == before, what


def test_a_role_with_the_runs_own_config_is_not_refused_for_it(made, tmp_path: Path, capsys, monkeypatch) -> None:
    """The same --config as the run's passes the config check (and is refused only for
    the run directory's missing data, the next check)."""
    cfg_dict, _ = made
    _run_store(tmp_path / "store", cfg_dict, tmp_path / "run")
    same = tmp_path / "same.yaml"
    same.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg_dict)))
    code, err = run_cli(main, ["worker", tmp_path / "store", "--config", same], capsys, monkeypatch)
    assert code == 2 and "prepared data" in err and "config" not in err.split("prepared data")[0]


def test_status_shows_paths_leases_modules_synchronisers_and_hosts(made, tmp_path: Path, capsys,
                                                                     monkeypatch) -> None:
    cfg_dict, _ = made
    st = _run_store(tmp_path / "store", cfg_dict, Path("/runs/a"))
    st.put_json(progress_key(0), {"phases_done": 2, "steps_done": 8})
    assert Lease(st, "path_1", "W3.0-abc", 30.0).acquire()
    assert Lease(st, "module_L0.0", "sync-h2-9-0", 30.0).acquire()
    now = time.time()
    st.put_json("syncs/sync-h2-9-0.json", {"name": "sync-h2-9-0", "host": "h2", "pid": 9, "t": now,
                                           "modules": ["L0.0"], "ended": None})
    st.put_json("hosts/h1-5.json", {"host": "h1", "pid": 5, "role": "worker", "t": now, "ended": None,
                                    "workers": [{"slot": 3, "alive": True}], "syncs": []})
    st.put_json("speed/worker_3.json", {"s_per_step": 0.25, "t": now})
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["status", str(tmp_path / "store"), "--json"])
    assert done.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["steps_done"] for p in out["paths"]] == [8, 0] and out["paths"][0]["lease"] is None
    assert out["paths"][1]["lease"]["owner"] == "W3.0-abc" and out["paths"][1]["lease"]["epoch"] == 1
    mods = {m["module"]: m for m in out["modules"]}
    assert mods["L0.0"]["lease"]["owner"] == "sync-h2-9-0" and mods["head"]["lease"] is None
    assert {m["version"] for m in out["modules"]} == {0}
    assert out["synchronisers"]["sync-h2-9-0"]["modules"] == ["L0.0"]
    assert out["hosts"]["h1-5"]["role"] == "worker" and out["workers"] == [
        {**out["workers"][0], "slot": 3, "host": "h1-5", "s_per_step": 0.25}]
    with pytest.raises(SystemExit):
        main(["status", str(tmp_path / "store")])
    text = capsys.readouterr().out
    for needle in ("path 1: 0/8 steps", "W3.0-abc (epoch 1", "L0.0: version 0 (no step yet)",
                   "synchroniser sync-h2-9-0", "h1-5 (worker): workers [3] (1 alive)", "slot 3 on h1-5: 0.250 s/step"):
        assert needle in text, (needle, text)
