"""How the package starts its processes (dipaco/runtime/process_start.py): forked from a
preloaded server, each takes over the launcher's environment and standard streams as they
are when it starts, not as they were when the server started."""
from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path

import pytest

from dipaco.runtime import faults, process_start
from dipaco.runtime.process_start import Handover, LaunchError, child_env, enter


def test_child_env_is_the_launchers_plus_what_the_starter_set() -> None:
    launch = {"A": "launch", "KEEP": "1", "FAULT": "now"}
    starting = {"A": "server", "STALE": "x", "KEEP": "1"}  # the server's, from an earlier launch
    current = {"A": "server", "STALE": "x", "KEEP": "1", "RANK": "3", "MASTER_PORT": "9"}  # + the agent's
    assert child_env(launch, starting, current) == {"A": "launch", "KEEP": "1", "FAULT": "now",
                                                    "RANK": "3", "MASTER_PORT": "9"}
    # what the starter set wins over the launcher's snapshot (it is the more specific)
    assert child_env({"RANK": "0"}, {}, {"RANK": "2"}) == {"RANK": "2"}


def test_a_handover_pickled_outside_a_process_start_carries_no_streams() -> None:
    h = pickle.loads(pickle.dumps(process_start.handover()))
    assert h.stdio is None and h.env == dict(os.environ)


def test_enter_without_a_handover_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIPACO_TEST_MARK", "1")
    before = dict(os.environ)
    enter(None)
    assert dict(os.environ) == before


def test_enter_applies_the_launchers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIPACO_TEST_STALE", "1")  # the server's, gone from the launcher since
    monkeypatch.setenv("DIPACO_TEST_NEW", "0")  # (monkeypatch restores both whatever enter does)
    launch = {k: v for k, v in os.environ.items() if k != "DIPACO_TEST_STALE"}
    launch["DIPACO_TEST_NEW"] = "2"
    monkeypatch.setattr(process_start, "_STARTING_ENV", dict(os.environ))
    monkeypatch.setenv("DIPACO_TEST_OWN", "3")  # set by the process's starter after it began
    enter(Handover(launch))
    assert "DIPACO_TEST_STALE" not in os.environ and os.environ["DIPACO_TEST_NEW"] == "2"
    assert os.environ["DIPACO_TEST_OWN"] == "3"


def test_the_start_method_is_forkserver_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(process_start.START_METHOD_ENV, raising=False)
    assert process_start.start_method() == ("forkserver" if sys.platform != "win32" else "spawn")
    monkeypatch.setenv(process_start.START_METHOD_ENV, "spawn")
    assert process_start.start_method() == "spawn"
    monkeypatch.setenv(process_start.START_METHOD_ENV, "fork")  # never: see the module's hazards
    with pytest.raises(LaunchError, match="DIPACO_START_METHOD='fork'.*forkserver, spawn"):
        process_start.start_method()


def test_an_agent_announces_its_pid_to_its_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.AGENT_PID_ENV, raising=False)
    assert faults.agent_pid() == os.getppid()  # torchrun: the agent is the parent
    monkeypatch.setenv(faults.AGENT_PID_ENV, "12345")
    assert faults.agent_pid() == 12345


def _report(out: str, tag: str, handover: Handover) -> None:
    """A started process: take over, then say what it sees (a file, and a line on stdout)."""
    enter(handover)
    env = {k: v for k, v in os.environ.items() if k.startswith("DIPACO_TEST_")}
    Path(out).write_text(json.dumps({"env": env, "ppid": os.getppid()}))
    print(f"started process says {tag}", flush=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_started_process_sees_the_launcher_as_it_is_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture) -> None:
    """Two processes from the same server: the second sees the environment and stdout of its
    own start (a variable set and one removed, and stdout moved, after the first start,
    which may have started the server); both are children of the server, not of the
    launcher."""
    monkeypatch.delenv(process_start.START_METHOD_ENV, raising=False)
    monkeypatch.setenv("DIPACO_TEST_FIRST", "1")
    ctx = process_start.context()
    first_out = tmp_path / "first.out"
    seen = []
    for tag in ("one", "two"):
        p = ctx.Process(target=_report, args=(str(tmp_path / f"{tag}.json"), tag, process_start.handover()))
        if tag == "one":  # the launcher's stdout is a file while the first process (and the server) start
            sys.stdout.flush()
            saved = os.dup(1)
            with open(first_out, "wb") as f:
                os.dup2(f.fileno(), 1)
            try:
                p.start()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
        else:
            p.start()
        p.join(90)
        assert p.exitcode == 0, p.exitcode
        seen.append(json.loads((tmp_path / f"{tag}.json").read_text()))
        if tag == "one":  # between the two starts the launcher changes: the server keeps what it had
            monkeypatch.delenv("DIPACO_TEST_FIRST")
            monkeypatch.setenv("DIPACO_TEST_SECOND", "2")
    assert seen[0]["env"] == {"DIPACO_TEST_FIRST": "1"}
    assert seen[1]["env"] == {"DIPACO_TEST_SECOND": "2"}
    assert "started process says one" in first_out.read_text()
    out = capfd.readouterr().out
    assert "started process says two" in out and "started process says one" not in out
    if process_start.start_method() == "forkserver":
        assert seen[0]["ppid"] == seen[1]["ppid"] != os.getpid()  # the server is their parent


def test_a_rank_that_lost_a_peer_is_told_apart_from_one_that_failed() -> None:
    from dipaco.runtime.launch import lost_a_peer

    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2463. "
                        "This is typically caused by a remote worker crashing.")
    assert lost_a_peer(gone) and lost_a_peer(RuntimeError("Connection reset by peer"))
    assert not lost_a_peer(RuntimeError("CUDA out of memory")) and not lost_a_peer(ValueError("nan loss"))
