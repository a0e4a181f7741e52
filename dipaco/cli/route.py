"""``dipaco-route``: tokenize a dataset, train the dense warm-up (where the config has
one), fit the router, write shards and the routing report.

Same config groups as ``dipaco-train``; the output directory then serves as the start
of a training run: ``dipaco-train hydra.run.dir=DIR`` continues from what it holds, with
its saved config (:mod:`dipaco.run.routed`: a key its artefacts were made from is refused,
nothing is rebuilt). It writes only a new directory: one that already holds a run
(``config.yaml``) is refused, untouched.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dipaco.run.checkpoint import atomic_write_text
from dipaco.cli.errors import entry_point, report_user_errors
from dipaco.cli.hydra_app import config_from_hydra, hydra_record, run_command
from dipaco.config import register_configs
from dipaco.run.path_guard import check_run_root, check_target
from dipaco.run.record import write_run_config
from dipaco.job.prepare import prepare
from dipaco.run.resume import check_fresh
from dipaco.run.run_dir import RunDir, RunDirError, disk_full_guard
from dipaco.run.lock import RunLock, check_unlocked
from dipaco.job.preflight import preflight
from dipaco.storage.strict_json import dumps_strict

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://dipaco.conf", config_name="config")
@report_user_errors
def _app(cfg: DictConfig) -> None:
    conf = config_from_hydra(cfg)
    preflight(conf)
    run = RunDir.at(conf.run_dir)
    if run.config.exists():
        raise RunDirError(f"{run.root} already holds a run (config.yaml); dipaco-route writes a new run "
                          "directory: choose another hydra.run.dir")
    check_run_root(run.root)
    check_fresh(run)  # a new directory, or one holding only what dipaco writes
    check_target(conf.data.cache_dir or run.cache, "data.cache_dir", own_run=run.root, owned=("cache",), folder=True)
    check_unlocked(run.root)
    with RunLock(run.root), disk_full_guard(run):
        for rel, text in hydra_record(cfg).items():
            atomic_write_text(run.root / rel, text)
        write_run_config(run, conf)
        prep = prepare(conf, run)
    keys = ("num_documents", "shard_sizes", "imbalance", "nmi", "purity", "levels")
    # each stage's seconds and the peak RSS after it (benchmarks/bench_prepare.py reads them)
    print(dumps_strict({**{k: prep.report.get(k) for k in keys}, "timings": prep.timings}))


@entry_point
def main() -> None:
    """Console-script entry point."""
    run_command("dipaco-route", _app)


if __name__ == "__main__":
    main()
