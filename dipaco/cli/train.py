"""``dipaco-train``: route → train paths with per-module DiLoCo → evaluate → summary.

A thin ``@hydra.main`` over :func:`dipaco.job.train.train`, which tests call directly.
``dipaco-train hydra.run.dir=D resume=true`` needs nothing else: the run's saved config
is used (:mod:`dipaco.run.resume`).
"""
from __future__ import annotations


import hydra
from omegaconf import DictConfig

from dipaco.cli.errors import entry_point, report_user_errors
from dipaco.cli.hydra_app import command_line_overrides, config_from_hydra, hydra_record, run_command
from dipaco.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://dipaco.conf", config_name="config")
@report_user_errors
def _app(cfg: DictConfig) -> float:
    # imported here: every rank that launcher=spawn starts re-imports this console script
    # (multiprocessing's spawn runs the parent's main module), and the job's data
    # preparation would cost each of them a second of imports it never uses
    from dipaco.job.train import train

    conf = config_from_hydra(cfg)
    summary = train(conf, overrides=command_line_overrides(), hydra_files=hydra_record(cfg))
    # Returned for Hydra sweepers that optimise an objective.
    return float(summary.get("routed_ppl", float("nan")))


@entry_point
def main() -> None:
    """Console-script entry point."""
    run_command("dipaco-train", _app)


if __name__ == "__main__":
    main()
