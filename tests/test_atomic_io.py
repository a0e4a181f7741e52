"""One writer for files (dipaco/storage/atomic.py), tensor files (run/tensor_io.py) and hashes
(run/hashing.py): the write rules, and the bytes and values pinned to what the writers
produced before they moved there (a checkpoint, a cache key or a split must not change)."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch

from dipaco.data.splits import id_unit_interval
from dipaco.storage import atomic
from dipaco.storage.atomic import atomic_write_bytes, atomic_write_text, write_atomically, write_json
from dipaco.run.checkpoint import CheckpointManager
from dipaco.storage.hashing import sha256_digest, sha256_file, sha256_hex, short_key, stable_u64
from dipaco.storage.tensor_io import load_state, save_state, tensors_from_bytes, tensors_to_bytes

# sha256 of the files the checkpoint writers produced for this state before they moved
# into run/atomic.py and run/tensor_io.py (computed on the code they came from)
_STATE_SHA = "5ec2ecef80a55bd61b7347c14817382828caa647531d2d840b93c71a0cc25d6e"
_JSON_SHA = "095ea055d447066bb82ba7db45c33b3dbb8002f94acc654a33b9c8663aeef1b1"


def _state() -> dict:
    return {"step": 7, "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "opt": {0: {"m": torch.ones(2, dtype=torch.bfloat16)}}, "pos": [1, 2.5, "x", None]}


def test_checkpoint_files_are_byte_identical_to_the_earlier_writer(tmp_path: Path) -> None:
    save_state(tmp_path / "s.safetensors", _state())
    write_json(tmp_path / "j.json", {"b": 1, "a": [1, 2]})
    assert sha256_file(tmp_path / "s.safetensors") == _STATE_SHA
    assert sha256_file(tmp_path / "j.json") == _JSON_SHA
    back = load_state(tmp_path / "s.safetensors")
    assert back["step"] == 7 and back["pos"] == [1, 2.5, "x", None]
    assert torch.equal(back["w"], _state()["w"]) and back["opt"][0]["m"].dtype == torch.bfloat16


def test_hashes_keep_their_values() -> None:
    """Split assignment, sample order, dedupe keys and cache names read these values."""
    assert id_unit_interval("doc-1") == 0.0950961809862792
    assert id_unit_interval("é/π", salt="sample") == 0.1378380817028599
    assert stable_u64("doc-1") == 4752762565065110614
    assert short_key("abc:def") == "ec5952851b8051e1ecf6b607"
    assert sha256_hex('{"a": 1}') == "f9d86028c6e0d64e225186f96acb69338b2c59764df79162107f5c4bb34d1310"
    assert sha256_digest("src/x.py")[:8].hex() == "9b45576c1ad2f985"
    assert sha256_hex("\udcff") == sha256_hex("\udcff".encode("utf-8", "surrogatepass"))  # ids off a disk


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "a.json"
    atomic_write_text(target, "old\n")

    def half(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(target, half)
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["a.json"]


def test_written_files_get_the_umask_mode_and_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "t.txt", "x")
        save_state(tmp_path / "s.safetensors", _state())  # safetensors alone would give 0600
    finally:
        os.umask(old)
    for name in ("t.txt", "s.safetensors"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    assert len(synced) >= 2  # each file flushed before its rename


def test_concurrent_writers_of_one_target_never_share_a_temporary(tmp_path: Path) -> None:
    target = tmp_path / "same.bin"
    errors = []

    def write(i: int) -> None:
        try:
            for _ in range(20):
                atomic_write_bytes(target, bytes([i]) * 4096)
        except Exception as e:  # pragma: no cover - the failure this test looks for
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    data = target.read_bytes()
    assert not errors and len(data) == 4096 and len(set(data)) == 1
    assert os.listdir(tmp_path) == ["same.bin"]


def test_a_committed_checkpoint_verifies_and_a_changed_byte_does_not(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    part = mgr.begin(1)
    save_state(part / "modules" / "m.safetensors", _state())
    final = mgr.commit(1, {"round": 1})
    assert mgr.verify(final)["files"]["modules/m.safetensors"]["sha256"] == _STATE_SHA
    f = final / "modules" / "m.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + b"\x00")
    assert mgr.latest_valid() is None


def test_tensor_messages_round_trip_without_a_file() -> None:
    blob = tensors_to_bytes({"a": torch.ones(3)}, metadata={"k": "v"})
    assert torch.equal(tensors_from_bytes(blob)["a"], torch.ones(3))

