"""``dipaco-route``: fit the router on a dataset, write shards and the routing report.

Same config groups as ``dipaco-train``; the output directory then serves as the start
of a training run (``dipaco-train hydra.run.dir=DIR resume=true`` reuses it).
"""
from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig, OmegaConf

from dipaco.cli.errors import report_user_errors
from dipaco.cli.hydra_app import config_from_hydra
from dipaco.config import register_configs, validate_config
from dipaco.prepare import prepare
from dipaco.run_dir import RunDir

register_configs()


@hydra.main(version_base="1.3", config_path="pkg://dipaco.conf", config_name="config")
@report_user_errors
def _app(cfg: DictConfig) -> None:
    conf = config_from_hydra(cfg)
    validate_config(conf)
    run = RunDir.at(conf.run_dir)
    run.root.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(conf), run.config)
    prep = prepare(conf, run)
    keys = ("num_documents", "shard_sizes", "imbalance", "nmi", "purity")
    print(json.dumps({k: prep.report.get(k) for k in keys}))


def main() -> None:
    """Console-script entry point."""
    _app()


if __name__ == "__main__":
    main()
