"""FsspecStore (decoupled mode on an fsspec URL): its contract on fsspec's in-process
``memory://`` and on ``s3://`` (s3fs against the local S3 server of tests/_s3.py; what
only S3 has, conditional writes on the wire and races, is in test_decoupled_store_s3.py).

The memory filesystem is global within a process: every test uses its own root; every
S3 test its own bucket. Real AWS S3 and GCS are not exercised (no network here).
"""
from __future__ import annotations

import json
import time
import uuid

import pytest
import torch
from _s3 import s3  # noqa: F401 (fixture)

from dipaco.decoupled.fsspec_store import FsspecStore, open_store
from dipaco.decoupled.lease import Lease, LeaseLost
from dipaco.decoupled.store import FileStore, Store


def _url() -> str:
    return f"memory://t-{uuid.uuid4().hex}/run"


@pytest.fixture(params=["memory", "s3"])
def st(request: pytest.FixtureRequest) -> FsspecStore:
    if request.param == "s3":
        store = open_store(request.getfixturevalue("s3").url())  # through the probe, as a run opens it
        assert isinstance(store, FsspecStore)
        return store
    return FsspecStore(_url())


def test_memory_fs_exclusive_create_raises_file_exists() -> None:
    # what put_new relies on, checked on the installed fsspec
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(_url())
    with fs.open(f"{root}/k", "xb") as f:
        f.write(b"1")
    with pytest.raises(FileExistsError):
        with fs.open(f"{root}/k", "xb") as f:
            f.write(b"2")
    assert fs.cat_file(f"{root}/k") == b"1"


def test_contract_put_get_put_new_list_delete(st: FsspecStore) -> None:
    st.put("a/b.bin", b"one")
    st.put("a/b.bin", b"two")
    assert st.get("a/b.bin") == b"two" and st.get("a/missing") is None and st.get("a") is None
    assert st.put_new("a/c.bin", b"x") and not st.put_new("a/c.bin", b"y")
    assert st.get("a/c.bin") == b"x"
    st.put("a/sub/d.bin", b"d")
    st.put("a/.tmp-leftover", b"t")
    assert st.list("a") == ["b.bin", "c.bin", "sub"]  # sorted, folders included, temp names hidden
    assert st.list("nothing/here") == [] and st.list("a/sub") == ["d.bin"]
    st.delete("a/c.bin")
    st.delete("a/c.bin")  # missing: fine
    assert st.get("a/c.bin") is None and st.list("a") == ["b.bin", "sub"]
    for bad in ("../escape", "/abs", "a/../../b"):
        with pytest.raises(ValueError):
            st.put(bad, b"")
    assert repr(st) == f"FsspecStore({st.url!r})"


def test_move_and_missing_source(st: FsspecStore) -> None:
    st.put("inbox/u1.st", b"u1")
    st.move("inbox/u1.st", "archive/u1.st")
    assert st.get("inbox/u1.st") is None and st.get("archive/u1.st") == b"u1"
    assert st.list("inbox") == [] and st.list("archive") == ["u1.st"]
    st.move("inbox/u1.st", "archive/u1.st")  # already moved: no-op, archive kept
    st.move("inbox/never.st", "archive/never.st")
    assert st.get("archive/u1.st") == b"u1" and st.get("archive/never.st") is None


def test_json_and_state_roundtrip(st: FsspecStore) -> None:
    st.put_json("paths/0.json", {"b": 1, "a": [1, 2]})
    assert st.get_json("paths/0.json") == {"a": [1, 2], "b": 1} and st.get_json("paths/9.json") is None
    n = st.put_state("modules/m.st", {"w": torch.arange(3.0), "k": 2}, meta={"version": 4})
    assert n == len(st.get("modules/m.st") or b"")
    state, meta = st.get_state("modules/m.st")
    assert meta == {"version": 4} and state["k"] == 2 and torch.equal(state["w"], torch.arange(3.0))
    assert st.get_state("modules/none.st") is None


def test_event_log_chunks_in_order(st: FsspecStore) -> None:
    n = 2 * FsspecStore.FLUSH_LINES + 5
    for i in range(n):
        st.append_line("events/sync-0.jsonl", json.dumps({"e": "step", "i": i}))
    # two full chunks written, 5 lines still buffered
    def ids() -> list[int]:
        return [json.loads(x)["i"] for x in st.read_lines("events/sync-0.jsonl")]

    assert ids() == list(range(2 * FsspecStore.FLUSH_LINES))
    st.flush()
    assert ids() == list(range(n))
    st.flush()  # nothing pending: no empty chunk
    assert len(st.list("events/sync-0.jsonl.d")) == 3
    # the log shows up as its key (metrics.load_events lists "events"), chunks hidden
    assert st.list("events") == ["sync-0.jsonl"]
    assert st.read_lines("events/missing.jsonl") == []


def test_event_log_time_and_lifecycle_flush(st: FsspecStore) -> None:
    key = "events/learner-L0.jsonl"
    st.append_line(key, json.dumps({"e": "progress", "steps": 1}))
    st.append_line(key, "not json with \"e\": \"end\" inside")  # substring only: not urgent
    assert st.read_lines(key) == []
    st.append_line(key, json.dumps({"e": "begin", "path": 0}))  # lifecycle: readable at once
    lines = st.read_lines(key)
    assert len(lines) == 3
    assert json.loads(lines[0])["e"] == "progress" and json.loads(lines[2])["e"] == "begin"
    st.append_line(key, json.dumps({"e": "progress", "steps": 2}))
    assert len(st.read_lines(key)) == 3
    st._last_flush[key] -= FsspecStore.FLUSH_S + 0.5  # as if the last chunk were > 1 s old
    st.append_line(key, json.dumps({"e": "progress", "steps": 3}))  # 1 s since last chunk
    assert len(st.read_lines(key)) == 5
    # a second writer (a restarted process) on the same log: its chunks follow, none lost
    time.sleep(0.01)  # writer tags start with the start time (µs)
    other = FsspecStore(st.url)
    other.append_line(key, json.dumps({"e": "hello"}))
    assert json.loads(st.read_lines(key)[-1]) == {"e": "hello"} and len(st.read_lines(key)) == 6


def test_filestore_flush_is_noop(tmp_path) -> None:
    fs = FileStore(tmp_path)
    fs.append_line("log.jsonl", "1")
    fs.flush()
    assert fs.read_lines("log.jsonl") == ["1"] and isinstance(fs, Store)


def test_open_store_memory_url_and_probe_cleanup() -> None:
    url = _url()
    st = open_store(url)
    assert isinstance(st, FsspecStore) and st.url == url
    assert st.list("") == [] and st.list(".probe") == []  # the probe key was deleted
    assert isinstance(open_store("file:///tmp/x-" + uuid.uuid4().hex), FileStore)


def test_open_store_refuses_backend_without_exclusive_create(monkeypatch: pytest.MonkeyPatch) -> None:
    # a backend that silently overwrites: every create "succeeds"
    monkeypatch.setattr(FsspecStore, "put_new", lambda self, key, data: (self.put(key, data), True)[1])
    with pytest.raises(ValueError, match="store_url") as exc:
        open_store(_url())
    assert "create-if-absent" in str(exc.value) and "overwrote" in str(exc.value)


def test_open_store_refuses_backend_raising_on_exclusive_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    real_open = MemoryFileSystem._open

    def no_x(self, path, mode="rb", **kw):
        if "x" in mode:
            raise NotImplementedError("File mode not supported")
        return real_open(self, path, mode, **kw)

    monkeypatch.setattr(MemoryFileSystem, "_open", no_x)
    url = _url()
    with pytest.raises(ValueError, match="store_url") as exc:
        open_store(url)
    assert "NotImplementedError" in str(exc.value)
    monkeypatch.undo()
    assert FsspecStore(url).list("") == []  # nothing left behind


def test_open_store_unknown_or_missing_backend() -> None:
    with pytest.raises(ValueError, match="store_url"):
        open_store("nosuchproto://x")


def test_lease_on_fsspec_store(st: FsspecStore) -> None:
    a = Lease(st, "path_0", "A", lease_s=0.3)
    b = Lease(st, "path_0", "B", lease_s=0.3)
    assert a.acquire() and not b.acquire()
    assert not Lease.is_free(st, "path_0") and Lease.holder(st, "path_0") == "A"
    a.release()
    assert Lease.is_free(st, "path_0") and b.acquire() and b.epoch == a.epoch + 1
    with pytest.raises(LeaseLost):
        a.check()
    time.sleep(0.35)  # B stops heartbeating: C takes over, B learns it on renew
    c = Lease(st, "path_0", "C", lease_s=5)
    assert c.acquire() and c.took_over_from == "B"
    with pytest.raises(LeaseLost):
        b.renew()
    assert st.list("leases/path_0") == [f"{e:010d}.json" for e in (b.epoch, c.epoch)]
