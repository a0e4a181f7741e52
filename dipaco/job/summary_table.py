"""The table a finished run prints: the summary's headline numbers, one per line.

A number the run did not measure (no dense baseline: ``dense_ppl`` is nan and the ratio
``None``; no long evaluation; no re-routing) is left out, not printed as ``nan``/``None``.
"""
from __future__ import annotations

import math
from typing import Any


def _measured(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def summary_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(label, value)`` of every headline number the run measured."""
    rows = [("routed perplexity", s.get("routed_ppl")), ("dense same-size perplexity", s.get("dense_ppl")),
            ("ratio vs dense", s.get("ratio_vs_dense")),
            ("routed, re-routed perplexity", s.get("rerouted_ppl")),
            ("routed perplexity, long", s.get("routed_ppl_long")),
            ("ratio vs dense, long", s.get("ratio_vs_dense_long")),
            ("routed perplexity, last weights", s.get("routed_ppl_last_weights")),
            ("paths", s.get("num_paths")), ("rounds x H", f"{s.get('rounds')} x {s.get('inner_steps')}")]
    if _measured(s.get("bytes_sent")):
        rows.append(("bytes sent", f"{s['bytes_sent']:,}"))
    if _measured(s.get("ddp_bytes_equivalent")):
        rows.append(("DDP equivalent bytes", f"{int(s['ddp_bytes_equivalent']):,}"))
    rows += [("training tokens/s", s.get("tokens_per_s")), ("wall time (s)", s.get("wall_s"))]
    return [(k, v) for k, v in rows if _measured(v)]


def summary_table(s: dict[str, Any]) -> str:
    """The rows of :func:`summary_rows`, aligned, as printed at the end of a run."""
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in rows)


__all__ = ["summary_rows", "summary_table"]
