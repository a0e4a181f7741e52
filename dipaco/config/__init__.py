"""The configuration: schema, domains, checks and composition, with no data or run I/O.

The ground floor: no module here imports another dipaco package, torch or faiss
(``tests/test_layout.py``); what only the code can answer is :mod:`dipaco.job.preflight`'s.

* :mod:`~dipaco.config.schema`: the dataclasses Hydra's ConfigStore type-checks against;
* :mod:`~dipaco.config.decoupled`: the settings of decoupled mode (``diloco.decoupled``);
* :mod:`~dipaco.config.names`: the registries of named choices (codecs, data sources, devices);
* :mod:`~dipaco.config.domains`: every key's domain, in one table;
* :mod:`~dipaco.config.validate`: ``validate_config``, the domains then the relations;
* :mod:`~dipaco.config.schedule`: step counts and the learning-rate schedule;
* :mod:`~dipaco.config.compose`: Hydra composition into a typed ``Config``;
* :mod:`~dipaco.config.errors`: ``ConfigError(key, problem, fix)``.

``from dipaco.config import Config, ConfigError, compose_config`` is the public surface;
``validate``, ``domains`` and ``names`` are imported from their modules.
"""
from dipaco.config.compose import compose_config, register_configs, to_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.config.errors import ConfigError, composition_error, require
from dipaco.config.schema import (Config, DataConfig, DiLoCoConfig, GridConfig, LauncherConfig, LoggingConfig,
                                  OuterOptimizerConfig, RouterConfig, TrainerConfig, codec_kwargs, eval_window)

__all__ = ["Config", "ConfigError", "DataConfig", "DecoupledConfig", "DiLoCoConfig", "GridConfig", "LauncherConfig",
           "LoggingConfig", "OuterOptimizerConfig", "RouterConfig", "TrainerConfig", "codec_kwargs",
           "composition_error", "compose_config", "eval_window", "register_configs", "require",
           "to_config"]
