"""What the hostile-input tests share (tests/test_hostile.py, tests/test_hostile_rules.py):
helpers that snapshot a directory and run a CLI in-process, and two tiny runs made once
per session (tests/conftest.py registers them), which tests only ever copy."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from dipaco.config import compose_config
from dipaco.job.train import train

SMOKE = ["experiment=smoke", "data.max_documents=200"]


# ------------------------------------------------------------------ helpers


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (hidden ones included), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def tiny_jsonl(path: Path, n: int) -> list[str]:
    """``n`` small documents as jsonl; the overrides that train on them."""
    path.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}  # document {i}\n" * 3}) + "\n"
                            for i in range(n)))
    return ["data=jsonl", f"data.path={path}"]


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def run_cli(main: Callable[[], Any], argv: list[str], capsys: pytest.CaptureFixture,
            monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """A console script in-process: (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["dipaco", *map(str, argv)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def one_line(err: str, *needles: str) -> str:
    """The single non-empty stderr line, which must contain every needle."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def subprocess_cli(module: str, *args: str, cwd: Path, **kw: Any) -> subprocess.Popen:
    env = dict(os.environ, HYDRA_FULL_ERROR="0", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", f"from {module} import main; main()", *args], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


# ------------------------------------------------------------------ shared runs


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    return run_dir, train(compose_config(SMOKE, run_dir))


@pytest.fixture(scope="session")
def sigterm_stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The real CLI, SIGTERM while it prepares: it trains round 1, checkpoints, stops."""
    base = tmp_path_factory.mktemp("sigterm")
    run_dir = base / "run"
    proc = subprocess_cli("dipaco.cli.train", *SMOKE, f"hydra.run.dir={run_dir}", cwd=base)
    assert proc.stdout is not None
    for line in proc.stdout:  # the corpus is loaded: the rounds have not started
        if line.startswith("[dipaco] corpus:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    return run_dir, err


