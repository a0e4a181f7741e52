"""The one piece of Hydra glue both Hydra CLIs share: typed config + run directory."""
from __future__ import annotations

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dipaco.config import Config, resolve_tokenizer_vocab, to_config


def config_from_hydra(cfg: DictConfig) -> Config:
    """The typed config, with ``run_dir`` defaulting to Hydra's output directory.

    With ``data.tokenizer`` set, ``model.vocab_size`` comes from that tokenizer unless
    given on the command line (then ``prepare`` refuses a size too small for it).
    """
    conf = to_config(cfg)
    hydra = HydraConfig.get()
    if conf.run_dir is None:
        conf.run_dir = hydra.runtime.output_dir
    return resolve_tokenizer_vocab(conf, hydra.overrides.task)
