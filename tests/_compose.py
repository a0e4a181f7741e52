"""Fast config composition for table tests over many command lines: Hydra composes the
group choices (seconds on a loaded host, once per combination), the ``key=value``
overrides are merged onto the typed result (milliseconds)."""
from __future__ import annotations

import copy
import functools

from omegaconf import OmegaConf

from dipaco.config import Config, compose_config

GROUPS = ("data", "model", "grid", "router", "diloco", "trainer", "launcher", "experiment", "sweep")


@functools.lru_cache(maxsize=None)
def _groups(choices: tuple[str, ...]) -> Config:
    return compose_config(list(choices))


def compose(overrides: list[str]) -> Config:
    """``compose_config(overrides)`` for group choices and plain keys (no ``+``/``~``)."""
    groups = tuple(o for o in overrides if o.split("=", 1)[0] in GROUPS)
    keys = [o for o in overrides if o.split("=", 1)[0] not in GROUPS]
    if not keys:
        return copy.deepcopy(_groups(groups))
    merged = OmegaConf.merge(OmegaConf.structured(_groups(groups)), OmegaConf.from_dotlist(keys))
    return OmegaConf.to_object(merged)
