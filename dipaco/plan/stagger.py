"""Streaming DiLoCo's staggered round (arXiv 2501.18512): when each module's exchange
launches and when its new global weights land, and the bytes in flight that costs.

A path is a chain of *stages*: the embedding, one module per level, the head (module ids
``embed*``, ``L<l>.<k>``, ``head*``; the alternatives of a level share a stage, so every
path holds exactly one module of each). The stages, in that order, are cut into
``fragments`` consecutive fragments (``diloco.streaming_fragments``; default one per
stage). Fragment ``i`` of ``n`` launches after inner step ``o_i`` of every round and
lands ``τ`` steps later (``diloco.streaming_delay``). The last fragment launches at
``H − τ``; the others before it, so that the gap after each launch (to the next one,
wrapping into the next round) is

* ``even``: ``H / n`` steps: one fragment every ``H / n`` steps, round after round;
* ``size``: in proportion to the fragment's bytes, so a big fragment (the embedding,
  the head) has the link for as long as its bytes need before the next one starts, and
  the bytes in flight stay level.

When τ leaves no room for that (the first launch would fall before step 1) the launches
are squeezed into ``[1, H − τ]``, keeping their proportions. The last fragment launches at ``H − τ`` and lands at step ``H``: every exchange lands in
the round it was launched in, so a round boundary (where checkpoints are taken) never
has one in flight. With one fragment and τ = 0 every module launches and lands at step
H: the synchronous round. The run's final round is synchronous too
(:meth:`RoundSchedule.of_round`), so no inner step of the run is left out of θ_global:
every module is exchanged once per round, as in the synchronous rounds.

Bytes in flight (:func:`inflight_peak`, over the schedule's fragments): right after the
sync point of step ``s`` the fragments launched at or before ``s`` that land after it, and
those launched and landed at ``s`` (the driver lands earlier modules first, then
launches, then lands the τ = 0 ones: :meth:`dipaco.sync.round_driver.RoundDriver.sync_point`).
The synchronous round has a whole path in flight at once; a staggered round one fragment
(plus any whose delay outlasts the gap to the next launch). Pure Python: ``dipaco-plan``
and the streaming driver both call it.
"""
from __future__ import annotations

import itertools
import re
from typing import Mapping, Optional, Sequence

from dipaco.plan.schedule import RoundSchedule, SyncPoint

__all__ = ["SPREADS", "format_stagger", "inflight_peak", "peak_bound", "stages", "streaming_schedule"]

#: diloco.streaming_spread choices
SPREADS = ("even", "size")

_LEVEL = re.compile(r"^L(\d+)\.")


def _stage_key(module_id: str, position: int) -> tuple[int, int]:
    """Sort key of a module's stage: the embedding first, the levels in order, the head
    last; an id of no known kind is a stage of its own at its place in the global order."""
    if module_id.startswith("embed"):
        return (0, 0)
    level = _LEVEL.match(module_id)
    if level:
        return (1, int(level.group(1)))
    if module_id.startswith("head"):
        return (2, 0)
    return (1, 10**6 + position)


def stages(module_ids: Sequence[str]) -> list[list[str]]:
    """The modules of each stage, stages in path order, modules in the global order."""
    keys: dict[tuple[int, int], list[str]] = {}
    for i, m in enumerate(module_ids):
        keys.setdefault(_stage_key(m, i), []).append(m)
    return [keys[k] for k in sorted(keys)]


def _cut(weights: Sequence[float], n: int) -> list[int]:
    """Where consecutive items of ``weights`` are cut into ``n`` non-empty runs as equal
    in weight as possible: the index each run ends at (exclusive)."""
    cum = list(itertools.accumulate(float(w) for w in weights))
    total, ends, prev = (cum[-1] if cum else 0.0), [], 0
    for i in range(1, n):
        target = total * i / n
        # at least one item per run, before and after this cut
        j = min(range(prev + 1, len(cum) - (n - i) + 1), key=lambda j: (abs(cum[j - 1] - target), j))
        ends.append(j)
        prev = j
    return ends + [len(cum)]


def streaming_schedule(module_ids: Sequence[str], inner_steps: int, delay: int, *,
                       fragments: Optional[int] = None, spread: str = "even",
                       sizes: Optional[Mapping[str, float]] = None) -> RoundSchedule:
    """The staggered round: every module's launch and landing step (module doc).

    Args:
        module_ids: every module, in the global order.
        inner_steps: H.
        delay: τ, ``0 ≤ τ < H``.
        fragments: how many fragments the stages are cut into (None: one per stage).
        spread: ``even`` or ``size`` (:data:`SPREADS`).
        sizes: bytes (or parameters) of each module, for ``size``: a stage weighs as its
            largest module, which is what one path holds of it.
    """
    H, tau = int(inner_steps), int(delay)
    if not 0 <= tau < H:
        raise ValueError(f"diloco.streaming_delay={delay} must be >= 0 and < diloco.inner_steps={H}")
    if spread not in SPREADS:
        raise ValueError(f"diloco.streaming_spread={spread!r} must be one of {', '.join(SPREADS)}")
    st = stages(module_ids)
    n = len(st) if fragments is None else int(fragments)
    if not 1 <= n <= len(st):
        raise ValueError(f"diloco.streaming_fragments={fragments} must be between 1 and the {len(st)} stages")
    by_size = spread == "size" and sizes is not None
    weight = [max(float(sizes[m]) for m in s) if by_size else 1.0 for s in st]  # type: ignore[index]
    if sum(weight) <= 0:  # nothing crosses the link (one worker group): spread evenly
        weight = [1.0] * len(st)
    ends = _cut(weight, n)
    frags = [st[a:b] for a, b in zip([0] + ends[:-1], ends)]
    frag_w = [sum(weight[a:b]) for a, b in zip([0] + ends[:-1], ends)]
    span, total = H - tau, sum(frag_w)
    # the gap after launch i (to the next launch, wrapping into the next round) is
    # H·w_i / W, and the last launch is at H − τ
    after = list(itertools.accumulate(frag_w[:-1][::-1]))[::-1] + [0.0]  # Σ of w_i .. w_{n-2}
    ideal = [span - H * a / total for a in after]
    if ideal[0] < 1:  # τ leaves no room for the first gaps: squeeze into [1, H − τ]
        lo = ideal[0]
        ideal = [1 + (x - lo) * (span - 1) / (span - lo) for x in ideal]
    out: dict[str, SyncPoint] = {}
    for frag, x in zip(frags, ideal):
        launch = min(span, max(1, round(x)))
        for s in frag:
            for m in s:
                out[m] = SyncPoint(launch, launch + tau)
    return RoundSchedule(H, {m: out[m] for m in module_ids})


def inflight_peak(schedule: RoundSchedule, modules: Sequence[str], nbytes: Mapping[str, int]) -> int:
    """The most bytes ``modules`` (one path's) have in flight at once in a round."""
    frags = [(f.launch, f.land, sum(int(nbytes[m]) for m in f.modules))
             for f in schedule.restrict(modules).fragments()]
    # right after the sync point of step s: launched by s and landing later, or at s itself
    return max((sum(n for a, b, n in frags if a <= s < b or a == b == s) for s, _, _ in frags), default=0)


def peak_bound(modules: Sequence[str], nbytes: Mapping[str, int]) -> int:
    """Issue #34's bound on a path's bytes in flight: its largest module plus one more."""
    top = sorted((int(nbytes[m]) for m in modules), reverse=True)
    return sum(top[:2])


def format_stagger(schedule: RoundSchedule, path_modules: Sequence[Sequence[str]], nbytes: Mapping[str, int]) -> str:
    """``dipaco-plan``'s streaming table: each fragment's steps and a path's bytes in flight."""
    lines = ["streaming schedule (per round; bytes per rank of one path's module):",
             f"{'launch':>7} {'lands':>6}  modules"]
    for f in schedule.fragments():
        lines.append(f"{f.launch:>7} {f.land:>6}  {' '.join(f.modules)}")
    sync = max(sum(int(nbytes[m]) for m in pm) for pm in path_modules)
    peak = max(inflight_peak(schedule, pm, nbytes) for pm in path_modules)
    bound = max(peak_bound(pm, nbytes) for pm in path_modules)
    lines.append(f"peak bytes in flight per path: {peak:,} streaming vs {sync:,} synchronous "
                 f"(bound: largest module + one more = {bound:,}; the final round is synchronous)")
    return "\n".join(lines)
