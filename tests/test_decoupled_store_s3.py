"""Decoupled mode's store on ``s3://``: s3fs against a local S3 server (tests/_s3.py).

What the protocol needs of an object store, checked on the wire: exclusive create is
S3's conditional write (one PUT carrying ``If-None-Match: *``), exactly one of many
racers wins, and the store probe refuses a server without conditional writes, one that
rejects them, and one that cannot be reached. The store's contract (put, list, moves,
event logs, leases) runs on S3 too: tests/test_decoupled_store_fsspec.py's ``st``
fixture covers both backends.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import pytest
from _s3 import IGNORE_CONDITIONS, REJECT_CONDITIONS, UNAVAILABLE, LocalS3, free_port, s3  # noqa: F401 (fixture)

from dipaco.decoupled.fsspec_store import PROBE_FOLDER, FsspecStore, open_store
from dipaco.decoupled.lease import Lease


def _race(attempts: list[Callable[[], bool]]) -> list[int]:
    """Every attempt at once (a barrier), each in a thread: the indices of those that won."""
    wins: list[int] = []
    barrier = threading.Barrier(len(attempts))

    def attempt(i: int) -> None:
        barrier.wait()
        if attempts[i]():
            wins.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(attempts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return wins


def _creates(stores: list[FsspecStore], key: str) -> list[Callable[[], bool]]:
    return [functools.partial(st.put_new, key, f"racer {i}".encode()) for i, st in enumerate(stores)]


def test_exclusive_create_is_one_conditional_put(s3: LocalS3) -> None:
    st = FsspecStore(s3.url())
    before = len(s3.requests("PUT"))
    assert st.put_new("leases/path_0/0000000001.json", b"{}")
    assert not st.put_new("leases/path_0/0000000001.json", b"{ }")
    puts = s3.requests("PUT")[before:]
    assert [(p, c) for _, p, c in puts] == [(f"/{s3.bucket}/run/leases/path_0/0000000001.json", "*")] * 2
    assert st.get("leases/path_0/0000000001.json") == b"{}"
    st.put("plain", b"x")  # a put replaces: no condition
    assert s3.requests("PUT")[-1][2] is None
    with pytest.raises(ValueError, match="non-empty"):  # s3fs would write b"" unconditionally
        st.put_new("empty", b"")
    assert st.get("empty") is None


def test_two_racers_one_winner(s3: LocalS3) -> None:
    # two clients of their own (two s3fs filesystems, as on two hosts)
    a, b = (FsspecStore(s3.url(), skip_instance_cache=True) for _ in range(2))
    for k in range(10):
        wins = _race(_creates([a, b], f"leases/path_{k}/0000000001.json"))
        assert len(wins) == 1, (k, wins)
        assert a.get(f"leases/path_{k}/0000000001.json") == f"racer {wins[0]}".encode()


def test_many_threads_one_winner_per_key(s3: LocalS3) -> None:
    st = FsspecStore(s3.url())
    for k in range(6):
        wins = _race(_creates([st] * 12, f"k{k}"))
        assert len(wins) == 1, (k, wins)
        assert st.get(f"k{k}") == f"racer {wins[0]}".encode()


def test_lease_race_and_takeover_on_s3(s3: LocalS3) -> None:
    st = open_store(s3.url())
    leases = [Lease(st, "path_3", f"w{i}", lease_s=0.5) for i in range(6)]
    got = _race([lease.acquire for lease in leases])
    assert len(got) == 1 and Lease.holder(st, "path_3") == f"w{got[0]}"
    time.sleep(0.6)  # the holder stops heartbeating: its lease expires
    late = Lease(st, "path_3", "late", lease_s=5)
    assert late.acquire() and late.took_over_from == f"w{got[0]}"


def test_open_store_on_s3_probes_and_cleans_up(s3: LocalS3) -> None:
    st = open_store(s3.url())
    assert isinstance(st, FsspecStore) and st.list("") == []
    assert s3.filesystem().find(f"{s3.bucket}/run/{PROBE_FOLDER}") == []
    conditional = [c for _, p, c in s3.requests("PUT") if f"/{PROBE_FOLDER}/" in p]
    assert conditional == ["*", "*"]  # created twice, conditionally; the second refused


def test_probe_refuses_a_server_without_conditional_writes(s3: LocalS3) -> None:
    # an S3-compatible server that ignores If-None-Match: every create silently overwrites
    with s3.misbehaving(IGNORE_CONDITIONS), pytest.raises(ValueError) as exc:
        open_store(s3.url())
    assert "store_url" in str(exc.value) and "overwrote" in str(exc.value)
    assert s3.filesystem().find(s3.bucket) == []  # the probe is gone


def test_probe_refuses_a_server_that_rejects_conditional_writes(s3: LocalS3) -> None:
    with s3.misbehaving(REJECT_CONDITIONS), pytest.raises(ValueError) as exc:
        open_store(s3.url())
    assert "store_url" in str(exc.value) and "lacks atomic create-if-absent" in str(exc.value)
    assert "OSError(38" in str(exc.value)  # 501 NotImplemented: ENOSYS


def test_probe_refuses_a_missing_bucket_without_creating_it(s3: LocalS3) -> None:
    missing = s3.url().replace(s3.bucket, s3.bucket + "-typo")
    with pytest.raises(ValueError) as exc:
        open_store(missing)
    msg = str(exc.value)
    assert "store_url" in msg and "cannot write to it" in msg and "bucket" in msg.lower() and "\n" not in msg
    assert not s3.filesystem().exists(s3.bucket + "-typo")


def test_probe_refuses_an_unreachable_or_failing_endpoint(s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    # botocore's own retries (s3fs retries a SlowDown 5 times more): bounded for the test;
    # a client reads the variable when it is made
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3fs.S3FileSystem.clear_instance_cache()
    with s3.misbehaving(UNAVAILABLE), pytest.raises(ValueError, match="cannot write to it") as exc:
        open_store(s3.url())
    msg = str(exc.value)
    assert "store_url" in msg and "reduce your request rate" in msg and "\n" not in msg, msg
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    s3fs.S3FileSystem.clear_instance_cache()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="cannot write to it") as exc:
        open_store(s3.url())
    assert "store_url" in str(exc.value) and "127.0.0.1" in str(exc.value), exc.value
    assert time.monotonic() - t0 < 30


def test_a_key_another_process_creates_after_a_listing_is_read(s3: LocalS3) -> None:
    """A long-lived reader lists a folder, another writer adds a key to it: the reader's
    get finds it (s3fs answered "not found" from its cached listing: the supervisor of a
    decoupled run on s3:// read every path's progress as absent and stopped at round 0)."""
    reader, writer = FsspecStore(s3.url()), FsspecStore(s3.url(), skip_instance_cache=True)
    writer.put_json("paths/path_0.json", {"steps_done": 1})
    assert reader.list("paths") == ["path_0.json"]  # the listing the reader would cache
    writer.put_json("paths/path_1.json", {"steps_done": 2})
    assert reader.get_json("paths/path_1.json") == {"steps_done": 2}
    assert reader.get_state("paths/none.st") is None
