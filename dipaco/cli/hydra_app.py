"""The one piece of Hydra glue both Hydra CLIs share: typed config + run directory."""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dipaco.config import Config, to_config


def config_from_hydra(cfg: DictConfig) -> Config:
    """The typed config, with ``run_dir`` defaulting to Hydra's output directory."""
    conf = to_config(cfg)
    if conf.run_dir is None:
        conf.run_dir = HydraConfig.get().runtime.output_dir
    return conf
