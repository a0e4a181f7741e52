"""The settings every router has, whatever its method: the views it reads and how shards are balanced.

:class:`RouterSettings` is the one list of them: ``Router.fit``'s keyword arguments, the
``settings`` of a saved router's manifest, and (with every method's settings,
``router.methods``) the ``router.*`` keys of dipaco's Hydra schema and of the router's
fingerprint all come from its fields. A routing method's own settings live in its config
dataclass (``router/methods/``).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, fields, replace
from typing import Any, Optional, TypeVar

from .assign import BALANCES


@dataclass
class RouterSettings:
    """What a router reads and how it balances shards (defaults: ``Router.fit``'s and the schema's)."""

    # tokens a prompt is routed on (Router.route)
    prefix_tokens: int = 32
    # tokens of each training document the router is fitted on and the shards assigned on
    # (null: prefix_tokens); prompts are still routed on prefix_tokens
    cluster_tokens: Optional[int] = None
    # a re-route (reroute_every) reads the last reroute_context tokens before its window;
    # null: everything read so far (docs/evaluation.md)
    reroute_context: Optional[int] = None
    # the paths each training document goes to (overlapping shards when > 1)
    top_k: int = 1
    # no shard above capacity_factor x the mean (router/assign.py)
    capacity_factor: float = 1.25
    # hard: every shard in [0.5, capacity_factor] x the mean; soft: a path keeps its natural
    # cluster within [1 / soft_capacity_factor, soft_capacity_factor] x the mean (router/assign.py)
    balance: str = "hard"
    soft_capacity_factor: float = 2.0
    # a classifier learns each training document's shard from its first prefix_tokens
    # tokens and routes prompts (and shards, and re-routes) from then on (router/router.py)
    prompt_classifier: bool = False

    def resolved(self) -> "RouterSettings":
        """These settings with ``cluster_tokens`` filled in (null: ``prefix_tokens``), as a
        fitted router keeps and saves them."""
        return typed(replace(self, cluster_tokens=self.cluster_tokens or self.prefix_tokens))

    def check(self, num_paths: int) -> None:
        """Refuse (ValueError naming the setting) values no router can work with on ``num_paths`` paths."""
        if int(self.prefix_tokens) < 1:
            raise ValueError(f"prefix_tokens must be >= 1, got {self.prefix_tokens}")
        if self.cluster_tokens is not None and int(self.cluster_tokens) < int(self.prefix_tokens):
            raise ValueError(f"cluster_tokens ({self.cluster_tokens}) must be >= prefix_tokens ({self.prefix_tokens}): "
                             "documents are clustered on at least the tokens they are routed on")
        if self.reroute_context is not None and int(self.reroute_context) < 1:
            raise ValueError(f"reroute_context must be >= 1 token or None (everything read so far), "
                             f"got {self.reroute_context}")
        if not 1 <= int(self.top_k) <= num_paths:
            raise ValueError(f"top_k must be in [1, {num_paths}] (the number of paths), got {self.top_k}")
        if not self.capacity_factor >= 1.0:
            raise ValueError(f"capacity_factor must be >= 1.0, got {self.capacity_factor}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        if self.balance == "soft" and not self.soft_capacity_factor >= self.capacity_factor:
            raise ValueError(f"soft_capacity_factor ({self.soft_capacity_factor}) must be >= capacity_factor "
                             f"({self.capacity_factor})")


T = TypeVar("T")


def typed(settings: T) -> T:
    """A copy of the dataclass ``settings`` with each number and flag cast to its field's
    type (``np.int64(8)`` → ``8``): what a manifest records must be plain JSON."""
    hints = typing.get_type_hints(type(settings))
    out: dict[str, Any] = {}
    for f in fields(settings):  # type: ignore[arg-type]
        v, kind = getattr(settings, f.name), hints[f.name]
        if typing.get_origin(kind) is typing.Union:  # Optional[X]: X, or None
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        out[f.name] = v if v is None or kind not in (int, float, bool, str) else kind(v)
    return replace(settings, **out)  # type: ignore[type-var]


__all__ = ["RouterSettings", "typed"]
