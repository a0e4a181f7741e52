"""The one JSON encoder of every file and line dipaco writes: strict JSON, never ``NaN``.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity``, which are not JSON: a
strict reader (``jq``, JavaScript, Go, most databases) refuses the whole file. A number
that is not finite (a diverged loss, a perplexity of ``exp(inf)``, an lm-eval standard
error of one sample) is written as ``null`` with the reason beside it: in an object, the
key ``<key>_nonfinite`` holds ``"nan"``, ``"inf"`` or ``"-inf"``; for items of a list, that
key maps each item's index to its reason. :func:`restore` turns that back into the float
(``metrics.jsonl``'s readers see the NaN loss they saw before; a strict reader sees null). ``allow_nan=False`` then guarantees that
nothing else slipped through. ``tests/test_writers.py`` scans the source: every
``json.dump``/``json.dumps`` that writes goes through :func:`dumps_strict`.
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

__all__ = ["NONFINITE_SUFFIX", "dumps_strict", "loads_restored", "restore", "strict"]

NONFINITE_SUFFIX = "_nonfinite"


def _reason(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _plain(x: Any) -> Any:
    """A numpy or torch scalar as the Python number it holds (anything else as it is)."""
    if not isinstance(x, (str, bytes, dict, list, tuple, int, float)) and callable(getattr(x, "item", None)):
        try:
            return x.item()
        except (TypeError, ValueError, RuntimeError):
            return x
    return x


def _clean(x: Any) -> tuple[Any, Optional[Any]]:
    """``(x with every non-finite float as None, the reasons)``: a string for a number,
    a dict (by index or key) for a container, None when all is finite."""
    x = _plain(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None, _reason(x)
    if isinstance(x, dict):
        out: dict[Any, Any] = {}
        for k, v in x.items():
            clean, why = _clean(v)
            out[k] = clean
            if why is not None:
                out[f"{k}{NONFINITE_SUFFIX}"] = why
        return out, None
    if isinstance(x, (list, tuple)):
        items, whys = [], {}
        for i, v in enumerate(x):
            clean, why = _clean(v)
            items.append(clean)
            if why is not None:
                whys[str(i)] = why
        return items, (whys or None)
    return x, None


def strict(obj: Any) -> Any:
    """``obj`` with every non-finite number replaced as the module says (a non-finite
    number or a list holding some at the top level becomes ``{"value": ..., "value_nonfinite": ...}``)."""
    clean, why = _clean(obj)
    if why is not None:
        return {"value": clean, f"value{NONFINITE_SUFFIX}": why}
    return clean


def dumps_strict(obj: Any, **kw: Any) -> str:
    """``json.dumps`` of :func:`strict` ``(obj)``, refusing anything not JSON (``allow_nan=False``);
    the other keywords (``indent``, ``sort_keys``, ``default``, ...) as ``json.dumps`` takes them."""
    kw.pop("allow_nan", None)
    return json.dumps(strict(obj), allow_nan=False, **kw)


_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def restore(obj: Any) -> Any:
    """The inverse of :func:`strict`: every ``null`` with its ``_nonfinite`` reason beside it
    is the float it was, and the reasons are dropped."""
    if isinstance(obj, list):
        return [restore(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {k: restore(v) for k, v in obj.items() if not (isinstance(k, str) and k.endswith(NONFINITE_SUFFIX))}
    for k, why in obj.items():
        if not (isinstance(k, str) and k.endswith(NONFINITE_SUFFIX)):
            continue
        key = k[: -len(NONFINITE_SUFFIX)]
        if isinstance(why, str) and out.get(key, 0) is None:
            out[key] = _VALUES.get(why)
        elif isinstance(why, dict) and isinstance(out.get(key), list):
            for i, w in why.items():
                if str(i).isdigit() and int(i) < len(out[key]) and out[key][int(i)] is None:
                    out[key][int(i)] = _VALUES.get(w)
    if set(out) == {"value"} and f"value{NONFINITE_SUFFIX}" in obj:
        return out["value"]
    return out


def loads_restored(text: str) -> Any:
    """``json.loads`` of a file :func:`dumps_strict` wrote, its non-finite numbers restored."""
    return restore(json.loads(text))
