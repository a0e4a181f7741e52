"""``dipaco-train``: route → train paths with per-module DiLoCo → evaluate → summary.

A thin ``@hydra.main`` over :func:`dipaco.train.train`, which tests call directly.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dipaco.cli.errors import report_user_errors
from dipaco.cli.hydra_app import config_from_hydra
from dipaco.config import register_configs
from dipaco.train import train

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://dipaco.conf", config_name="config")
@report_user_errors
def _app(cfg: DictConfig) -> float:
    conf = config_from_hydra(cfg)
    summary = train(conf)
    # Returned for Hydra sweepers that optimise an objective.
    return float(summary.get("routed_ppl", float("nan")))


def main() -> None:
    """Console-script entry point."""
    _app()


if __name__ == "__main__":
    main()
