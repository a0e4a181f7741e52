"""``ConfigError``: a configuration that cannot work, said in one line naming the key and
the fix (docs/design.md, "Errors a user can cause"). Re-exported by :mod:`dipaco.config`."""
from __future__ import annotations

__all__ = ["ConfigError", "composition_error", "require"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key = key
        super().__init__(f"config error: {key}: {problem}. Fix: {fix}")


def require(ok: bool, key: str, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` ``(key, problem, fix)`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, problem, fix)


def composition_error(e: Exception) -> ConfigError:
    """Hydra's multi-line composition error as one :class:`ConfigError` naming the key."""
    cause = e.__cause__ or e
    key = str(getattr(cause, "full_key", "") or "")
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if not key:
        words = [w for w in str(e).split() if "=" in w]
        key = words[0].split("=", 1)[0] if words else "override"
    return ConfigError(key, first.rstrip("."), f"give {key} a value of its type (dipaco-train --cfg job "
                                                "shows every key and its value)")
