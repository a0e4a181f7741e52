"""``dipaco-route``: fit the router, write shards and the routing report (docs/design.md, "Errors a user can cause")."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dipaco_route_writes_router_shards_and_report(tmp_path: Path) -> None:
    run = tmp_path / "route"
    proc = subprocess.run(
        [sys.executable, "-c", "from dipaco.cli.route import main; main()", "experiment=smoke",
         "data.max_documents=200", "grid.levels=[2,2]", f"hydra.run.dir={run}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    report = json.loads((run / "routing_report.json").read_text())
    assert printed["shard_sizes"] == report["shard_sizes"] and len(report["shard_sizes"]) == 4
    # the default top_k=2: every document is in two training shards
    assert sum(report["shard_sizes"]) == 2 * report["num_documents"] > 0
    assert report["imbalance"] <= 1.3 and 0.0 <= report["nmi"] <= 1.0  # stdlib labels exist
    assert (run / "router" / "manifest.json").is_file() and (run / "shards" / "shards.json").is_file()


@pytest.mark.multiprocess
def test_dipaco_route_config_error_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from dipaco.cli.route import main; main()", "router.top_k=0",
         f"hydra.run.dir={tmp_path}/r"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "router.top_k" in lines[0], proc.stderr
