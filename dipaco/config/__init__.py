"""The configuration: schema, domains, checks and composition, with no data or run I/O.

* :mod:`~dipaco.config.schema`: the dataclasses Hydra's ConfigStore type-checks against;
* :mod:`~dipaco.config.decoupled`: the settings of decoupled mode (``diloco.decoupled``);
* :mod:`~dipaco.config.domains`: every key's domain, in one table;
* :mod:`~dipaco.config.validate`: ``validate_config``, the domains then the relations;
* :mod:`~dipaco.config.schedule`: step counts and the learning-rate schedule;
* :mod:`~dipaco.config.compose`: Hydra composition into a typed ``Config``;
* :mod:`~dipaco.config.errors`: ``ConfigError(key, problem, fix)``.

``from dipaco.config import Config, ConfigError, compose_config`` is the public surface;
``validate`` and ``domains`` are imported from their modules (they import
:mod:`dipaco.sync`, which imports this package).
"""
from dipaco.config.compose import (compose_config, register_configs, resolve_tokenizer_vocab, to_config,
                                   tokenizer_size)
from dipaco.config.decoupled import DecoupledConfig
from dipaco.config.errors import ConfigError, composition_error, require
from dipaco.config.schema import (Config, DataConfig, DiLoCoConfig, GridConfig, LauncherConfig, LoggingConfig,
                                  OuterOptimizerConfig, RouterConfig, TrainerConfig, codec_kwargs, eval_window)

__all__ = ["Config", "ConfigError", "DataConfig", "DecoupledConfig", "DiLoCoConfig", "GridConfig", "LauncherConfig",
           "LoggingConfig", "OuterOptimizerConfig", "RouterConfig", "TrainerConfig", "codec_kwargs",
           "composition_error", "compose_config", "eval_window", "register_configs", "require",
           "resolve_tokenizer_vocab", "to_config", "tokenizer_size"]
