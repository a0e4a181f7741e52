"""Turning Hydra's composition into a typed :class:`~dipaco.config.schema.Config`.

The one module of :mod:`dipaco.config` that reads files: Hydra's YAML groups under
``conf/``. The schema, the domains and the checks (``schema``, ``domains``, ``validate``)
read nothing. ``model.vocab_size`` from a given tokenizer is the data's to say:
:func:`dipaco.job.preflight.compose` is this composition plus that step.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from dipaco.config.errors import ConfigError, composition_error
from dipaco.config.paths import pin_paths
from dipaco.config.schema import (Config, DataConfig, DiLoCoConfig, GridConfig, LauncherConfig, RouterConfig,
                                  TrainerConfig)
from modules.config import ModelConfig


def register_configs() -> None:
    """Register the schema so ``conf/config.yaml`` and its groups are type-checked."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="dipaco_schema", node=Config)
    cs.store(group="data", name="dipaco_data_schema", node=DataConfig)
    cs.store(group="model", name="dipaco_model_schema", node=ModelConfig)
    cs.store(group="grid", name="dipaco_grid_schema", node=GridConfig)
    cs.store(group="router", name="dipaco_router_schema", node=RouterConfig)
    cs.store(group="diloco", name="dipaco_diloco_schema", node=DiLoCoConfig)
    cs.store(group="trainer", name="dipaco_trainer_schema", node=TrainerConfig)
    cs.store(group="launcher", name="dipaco_launcher_schema", node=LauncherConfig)


def to_config(cfg: DictConfig | Config | dict) -> Config:
    """Turn a Hydra DictConfig (or a dict) into a typed :class:`Config` object."""
    if isinstance(cfg, Config):
        return cfg
    schema = OmegaConf.structured(Config)
    unknown = _unknown_keys(OmegaConf.to_container(OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg,
                                                   resolve=False), schema)
    if unknown:
        # Hydra's `+key=value` bypasses the schema; a misspelt key must not be ignored
        raise ConfigError(unknown[0], "unknown key: no such setting in dipaco's config schema",
                          "remove it (dipaco-train --cfg job lists every key)")
    merged = OmegaConf.merge(schema, cfg)
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj


def _unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a plain dict) that ``schema`` (a structured config) lacks."""
    out: list[str] = []
    for k, v in node.items():
        key = f"{prefix}{k}"
        if k not in schema:
            out.append(key)
        elif isinstance(v, dict) and OmegaConf.is_dict(schema[k]):
            out += _unknown_keys(v, schema[k], key + ".")
    return out


def compose_config(overrides: Optional[List[str]] = None, run_dir: Optional[str] = None) -> Config:
    """Compose ``conf/config.yaml`` with Hydra overrides, outside a Hydra app.

    For tests, notebooks and tools: ``train(compose_config(["experiment=smoke"], "runs/x"))``
    runs the same job as ``dipaco-train experiment=smoke hydra.run.dir=runs/x``. With
    ``data.tokenizer`` (or ``data=tokens``), compose with :func:`dipaco.job.preflight.compose`,
    which also sets ``model.vocab_size`` from the tokenizer as the CLIs do.
    """
    # Hydra is imported here, not at the top: a spawned rank and an inference process read
    # a config (OmegaConf) but never compose one, and ``import hydra`` costs them 0.1-0.4 s
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    register_configs()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dipaco.conf", version_base="1.3"):
        try:
            cfg = to_config(compose("config", overrides=list(overrides or [])))
        except HydraException as e:  # a value of the wrong type, a malformed override
            raise composition_error(e) from None
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    pin_paths(cfg)  # a path means one thing, whatever directory reads the config later
    return cfg
