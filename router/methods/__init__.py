"""The routing methods, by name: the registry.

Adding a router is one module in this folder, one YAML in ``conf/router/`` and one line
in :data:`REGISTRY` (docs/design.md, "Adding a router"). The module defines a
:class:`MethodConfig` dataclass (its settings, one field each, with their domains:
:func:`setting`) whose ``build`` makes a :class:`RoutingMethod` (``fit``, ``costs``,
``arrays`` / ``load_arrays``); see ``router/methods/base.py``. Nothing else names a
method: ``Router.fit`` and ``Router.load``, dipaco's ``router.method`` domain, its schema's
``router.*`` keys and the router's fingerprint all read this table.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import fields
from functools import lru_cache
from importlib import import_module
from typing import Any, Mapping, NamedTuple

from ..settings import RouterSettings
from .base import MethodConfig, RoutingMethod, setting

# method name → "module:ConfigClass" in this folder (imported by method_class; importing this
# package imports them all, to gather MethodSettings)
REGISTRY: dict[str, str] = {
    "product": "product:ProductConfig",  # router=kmeans, the default
    "tree": "tree:TreeConfig",
    "flat": "flat:FlatConfig",
    "grouped": "grouped:GroupedConfig",  # experimental
    "merge": "merge:MergeConfig",
    "random": "random:RandomConfig",  # the control
}

METHODS = tuple(REGISTRY)


def method_class(name: str) -> type[MethodConfig]:
    """The config dataclass of method ``name``; ValueError naming the methods for another name."""
    if name not in REGISTRY:
        raise ValueError(f"method must be one of {METHODS}, got {name!r}")
    module, cls = REGISTRY[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)


def method_config(name: str, values: Any = None, /, **settings: Any) -> MethodConfig:
    """The config of method ``name``: its settings read from ``values`` (any object with
    them as attributes, e.g. dipaco's ``cfg.router``; the others are not read), then
    ``settings``; a setting the method does not have is a TypeError naming its settings."""
    cls = method_class(name)
    own = [f.name for f in fields(cls)]
    unknown = sorted(set(settings) - set(own))
    if unknown:
        raise TypeError(f"method {name!r} has no setting {unknown[0]!r}; its settings: {own or 'none'}")
    read = {k: getattr(values, k) for k in own if values is not None}
    return cls(**{**read, **settings})


def split_settings(method: str | MethodConfig, settings: Mapping[str, Any]) -> tuple[RouterSettings, MethodConfig]:
    """``Router.fit``'s keyword settings as the router's (:class:`RouterSettings`) and the method's."""
    mine = {f.name for f in fields(RouterSettings)}
    router = RouterSettings(**{k: v for k, v in settings.items() if k in mine})
    rest = {k: v for k, v in settings.items() if k not in mine}
    if isinstance(method, MethodConfig):
        try:
            return router, dataclasses.replace(method, **rest)
        except TypeError:
            raise TypeError(f"method {method.name!r} has no setting among {sorted(rest)}") from None
    return router, method_config(method, **rest)


class Setting(NamedTuple):
    """One method setting: its type, default and domain (``setting``'s metadata)."""

    type: Any
    default: Any
    metadata: Mapping[str, Any]


@lru_cache(maxsize=None)
def method_settings() -> dict[str, Setting]:
    """Every method's settings by name, each once: a setting several methods have (``niter``)
    must have one type and default in all of them, and none may share a name with
    :class:`RouterSettings` (they are all ``router.<name>`` in dipaco's config)."""
    taken = {f.name for f in fields(RouterSettings)}
    out: dict[str, Setting] = {}
    for name in METHODS:
        cls = method_class(name)
        hints = typing.get_type_hints(cls)  # real types, not the strings of postponed annotations
        for f in fields(cls):
            if f.name in taken:
                raise TypeError(f"method {name!r} setting {f.name!r} is a router setting (router/settings.py)")
            mine = Setting(hints[f.name], f.default, dict(f.metadata))
            seen = out.setdefault(f.name, mine)
            if seen != mine:
                raise TypeError(f"setting {f.name!r} of method {name!r} differs from another method's: {mine} "
                                f"against {seen}")
    return out


def _union() -> type:
    """A dataclass of every method's settings (:func:`method_settings`), for dipaco's schema."""
    spec = [(n, s.type, dataclasses.field(default=s.default, metadata=s.metadata))
            for n, s in method_settings().items()]
    return dataclasses.make_dataclass("MethodSettings", spec)


MethodSettings = _union()
MethodSettings.__doc__ = "Every routing method's settings, each once (router.methods.method_settings)."

__all__ = ["METHODS", "REGISTRY", "MethodConfig", "MethodSettings", "RoutingMethod", "Setting", "method_class",
           "method_config", "method_settings", "setting", "split_settings"]
