"""The per-round metrics record of both sync modes: one ``metrics.jsonl`` line."""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["round_record"]


def round_record(round_idx: int, mode: str, paths: dict[str, dict], modules: dict[str, dict], *,
                 bytes_sent: int, compute_s: float, wait_s: float = 0.0, sync_s: float = 0.0,
                 tokens: int = 0, ddp_bytes: Optional[int] = None) -> dict[str, Any]:
    """One round's line: per-path loss/tokens/seconds, per-module sync statistics, bytes
    sent and the time split (``compute_s``: slowest worker group's inner steps;
    ``wait_s``: waiting for it; ``sync_s``: exchange + outer step).

    Sync mode writes one per round; decoupled mode one per phase index (``modules`` empty:
    its outer steps are per module, in ``events/sync-*.jsonl``). ``ddp_bytes``: what DDP
    would have sent in this round on this round's own topology (sync mode), so that the
    run's totals are sums of rounds whatever launched each (``run_totals``).
    """
    extra = {} if ddp_bytes is None else {"ddp_bytes_equivalent": int(ddp_bytes)}
    return {**extra, "round": int(round_idx), "mode": mode, "paths": paths, "modules": modules,
            "bytes_sent": int(bytes_sent), "tokens": int(tokens), "compute_s": float(compute_s), "wait_s": float(wait_s),
            "sync_s": float(sync_s)}
