"""Decoupled store blobs are verified where they are read (issue 56, rule 1): every state
blob (module version, update, path state) records the sha256 of its content in its
header, every JSON record (plan, progress, leases) in its ``_sha256`` field, and a read
that does not match is refused naming the key. A synchroniser drops a corrupt update as
``corrupt`` and goes on; a corrupt module version is an error naming its key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dipaco.cli.errors import known_error
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.lease import Lease
from dipaco.decoupled.merge import MergingModuleSync
from dipaco.decoupled.metrics import ledger_report
from dipaco.decoupled.owner import OWNER_KEY, check_store, claim_store
from dipaco.decoupled.module_leases import read_module, write_module
from dipaco.decoupled.service import SyncService, inbox
from dipaco.decoupled.store import CorruptBlob, FileStore, decode_json, decode_state, encode_json, encode_state
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.storage.tensor_io import tensors_to_bytes

AVG = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
STATE = {"w": torch.arange(6.0).reshape(2, 3), "half": torch.ones(3, dtype=torch.bfloat16), "flag": torch.tensor(True),
         "empty": torch.zeros(0), "ledger": {"applied": {"u1": 1}}, "n": 7}


def flipped(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x01
    return bytes(b)


def test_state_blob_round_trips_and_every_flipped_byte_is_refused() -> None:
    blob = encode_state(STATE, meta={"version": 3})
    state, meta = decode_state(blob)
    assert meta == {"version": 3} and state["n"] == 7 and state["ledger"] == {"applied": {"u1": 1}}
    assert torch.equal(state["w"], STATE["w"]) and state["half"].dtype == torch.bfloat16
    # one bit anywhere: the length prefix, the header (tensor table, skeleton, meta,
    # padding) or the tensors' bytes. Before digests, a bit in a tensor or a digit of
    # the meta JSON decoded silently into other numbers.
    for at in range(len(blob)):
        with pytest.raises(CorruptBlob):
            decode_state(flipped(blob, at))


def test_a_digit_of_the_meta_and_a_float_of_a_tensor_are_caught() -> None:
    blob = encode_state({"w": torch.full((4,), 1.5)}, meta={"version": 3})
    other = blob.replace(b'\\"version\\": 3', b'\\"version\\": 4')  # still valid JSON, another version
    assert other != blob
    with pytest.raises(CorruptBlob, match="does not match the sha256"):
        decode_state(other)
    with pytest.raises(CorruptBlob, match="does not match the sha256"):
        decode_state(flipped(blob, len(blob) - 1))  # the last float's low byte: a valid float


def test_a_blob_without_a_digest_or_not_a_blob_is_refused() -> None:
    bare = tensors_to_bytes({"w": torch.ones(2)}, metadata={"skeleton": json.dumps({"__tensor__": "w"}), "meta": "{}"})
    with pytest.raises(CorruptBlob, match="records no sha256"):
        decode_state(bare)
    for junk in (b"", b"\x00\x01not a blob", encode_state(STATE)[:-5]):
        with pytest.raises(CorruptBlob, match="not a store blob"):
            decode_state(junk)


def test_json_records_carry_and_check_their_digest() -> None:
    rec = {"rounds": 2, "sharing": {"m": [0, 1]}, "t": 1.5e-300, "neg": -0.0, "name": "é", "ints": {10: 1, 9: 2}}
    blob = encode_json(rec)
    assert decode_json(blob) == json.loads(json.dumps(rec))  # JSON's form: int keys are strings
    assert json.loads(blob)["rounds"] == 2  # still plain JSON for a human or another tool
    for bad, why in ((blob.replace(b'"rounds": 2', b'"rounds": 3'), "does not match"),
                     (json.dumps(rec, sort_keys=True).encode(), "records no sha256"),
                     (b'["a list"]', "records no sha256"), (blob[:-9], "not JSON")):
        with pytest.raises(CorruptBlob, match=why):
            decode_json(bad)
    with pytest.raises(TypeError):
        encode_json({"_sha256": "mine"})


def test_store_reads_name_the_key(tmp_path: Path) -> None:
    st = FileStore(tmp_path / "s")
    st.put_state("paths/path_0.st", STATE, meta={"phases_done": 1})
    st.put_json("plan.json", {"rounds": 2})
    (tmp_path / "s" / "paths" / "path_0.st").write_bytes(flipped(st.get("paths/path_0.st"), -1))
    (tmp_path / "s" / "plan.json").write_bytes(st.get("plan.json").replace(b"2", b"3"))
    with pytest.raises(CorruptBlob, match=r"key 'paths/path_0.st' is corrupt") as exc:
        st.get_state("paths/path_0.st")
    assert str(tmp_path / "s") in str(exc.value)
    with pytest.raises(CorruptBlob, match=r"key 'plan.json' is corrupt"):
        st.get_json("plan.json")
    assert st.get_state("paths/none.st") is None and st.get_json("none.json") is None
    # the CLIs' error boundary: one line, exit 2 (a corrupt file, as a corrupt checkpoint)
    assert known_error(CorruptBlob("key 'plan.json' is corrupt")) == ("key 'plan.json' is corrupt", 2)


def test_a_corrupt_lease_record_names_its_key(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    assert Lease(st, "path_0", "A", lease_s=30).acquire()
    key = "leases/path_0/0000000001.json"
    st.put(key, st.get(key).replace(b'"A"', b'"B"'))
    with pytest.raises(CorruptBlob, match="leases/path_0/0000000001.json"):
        Lease.is_free(st, "path_0")


def _update(module: str, uid: str, path: int, phase: int, delta: list[float]) -> bytes:
    d = torch.tensor(delta)
    meta = {"update_id": uid, "module_id": module, "path_id": path, "phase": phase, "base_version": 0,
            "tokens": 10.0, "codec": "none", "codec_kw": {}, "numel": d.numel(), "weighted": True}
    return encode_state({"payload": [d]}, meta)


def test_the_synchroniser_drops_a_corrupt_update_and_applies_the_rest(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    cfg = DecoupledConfig(quorum=1.0, poll_s=0.01, grace_init_s=60)
    write_module(st, MergingModuleSync("m", torch.zeros(3), [0, 1], cfg, AVG))
    st.put_new(f"{inbox('m')}/good.st", _update("m", "good", 0, 0, [10.0, 10.0, 10.0]))
    # a valid safetensors file whose last float lost a bit after it was written
    st.put_new(f"{inbox('m')}/bad.st", flipped(_update("m", "bad", 1, 0, [20.0, 20.0, 20.0]), -1))
    svc = SyncService(st, ["m"], {"m": [0, 1]}, rounds=1, cfg=cfg, outer=AVG, inner_steps=1)
    svc.poll_once({0, 1})  # both paths done: the good one is stepped alone
    _, state, meta = read_module(st, "m")
    assert state["dropped"] == {"bad": "corrupt"} and set(state["applied"]) == {"good"}
    assert not torch.equal(state["global"], torch.zeros(3)) and bool(torch.isfinite(state["global"]).all())
    assert ledger_report(st, ["m"])["ok"]
    drops = [json.loads(x) for x in st.read_lines("events/sync-0.jsonl") if '"drop"' in x]
    assert drops[0]["id"] == "bad" and "sha256" in drops[0]["error"]


def test_a_corrupt_module_version_is_an_error_naming_its_key(tmp_path: Path) -> None:
    st = FileStore(tmp_path)
    write_module(st, MergingModuleSync("m", torch.zeros(3), [0], DecoupledConfig(), AVG))
    path = tmp_path / "modules" / "m" / "0000000000.st"
    path.write_bytes(flipped(path.read_bytes(), -1))
    svc = SyncService(st, ["m"], {"m": [0]}, rounds=1, cfg=DecoupledConfig(), outer=AVG, inner_steps=1)
    with pytest.raises(CorruptBlob, match="key 'modules/m/0000000000.st' is corrupt"):
        svc.poll_once()  # takes the module's lease, then loads its newest revision


def _run(d: Path) -> RunDir:
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("seed: 0\n")
    (d / "fingerprints.json").write_text("{}\n")
    return RunDir.at(d)


def test_the_owner_record_is_checked_and_read_back_as_the_runs_own(tmp_path: Path) -> None:
    mine = _run(tmp_path / "mine")
    store = tmp_path / "shared-store"
    claim_store(str(store), mine, resume=False)
    assert "_sha256" in json.loads((store / OWNER_KEY).read_text())
    check_store(str(store), mine, resume=True)  # its own: the digest is not part of the name
    (store / OWNER_KEY).write_bytes((store / OWNER_KEY).read_bytes().replace(b"mine", b"mind"))
    with pytest.raises(RunDirError, match="owner.json is corrupt") as exc:
        check_store(str(store), mine, resume=True)
    assert "\n" not in str(exc.value)
