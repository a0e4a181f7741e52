"""Streaming DiLoCo against a float64 reference written from the equations.

Two rounds of a [2, 2] grid (the first staggered, the run's last synchronous) are driven
through :class:`dipaco.sync.round_driver.RoundDriver` exactly as
:func:`dipaco.rounds.loop.run_round` drives it, with the inner steps replaced
by hand-built increments of each path's live weights and hand-picked tokens per segment.
Beside it, :func:`reference` recomputes the round from docs/design.md's equations alone,
in float64 and plain Python: the fragment schedule, α = shard scale × the tokens since the
module's last launch, the α-weighted mean ΣαΔ/Σα, outer SGD with Nesterov momentum, and
the delayed landing ``copy ← m·copy + (1 − m)·θ_global`` (replaced when τ = 0 and in the
final round).

The code keeps θ_global and the copies in fp32 (``ModuleCore``), so float64 is not
available to it; instead every number is chosen to make its fp32 arithmetic exact:
increments are multiples of 1/16, lr = momentum = 1/2, m = 1/4, shard scales 3/2, 1/2, 1, 1
and per-path token rates 2, 2, 1, 3, so each module's Σα is (window tokens) × 4 or × 8
and ΣαΔ / Σα is a correctly rounded division whose true quotient is dyadic. Both sides
then agree to 1e-12 (in fact bit for bit), and α differs within every module.
"""
from __future__ import annotations

import torch
from torch import nn

from dipaco.plan.stagger import streaming_schedule
from dipaco.plan.topology import Topology
from dipaco.sync.alpha import PathAlpha
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.round_driver import RoundDriver

IDS = ["embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"]
PATHS = [["embed", f"L0.{p // 2}", f"L1.{p % 2}", "head"] for p in range(4)]
H, TAU, FRAGMENTS, KEEP, LR, MOMENTUM, ROUNDS, N = 4, 1, 3, 0.25, 0.5, 0.5, 2, 3
SHARD_TOKENS = [3, 1, 2, 2]  # α scale = shard / mean: 1.5, 0.5, 1, 1
RATE = [2, 2, 1, 3]  # tokens per unit of segment, per path: scale × rate = 3, 1, 1, 3
UNITS = {0: {1: 1, 2: 1, 3: 2, 4: 4}, 1: {4: 4}}  # units per segment, by round and end step
TOL = 1e-12


def reference_points() -> dict[str, tuple[int, int]]:
    """The staggered schedule from the equations: the stages (embed, L0, L1, head) cut
    into 3 fragments as equal as possible ([embed], [L0, L1], [head]); the last launches
    at H − τ; the gap after launch i is H·w_i/W; launches squeezed into [1, H − τ]."""
    frags = [["embed"], ["L0.0", "L0.1", "L1.0", "L1.1"], ["head"]]
    w = [1, 2, 1]  # stages per fragment
    ideal = [(H - TAU) - H * sum(w[i:-1]) / sum(w) for i in range(len(frags))]  # 0, 1, 3
    lo = ideal[0]
    if lo < 1:
        ideal = [1 + (x - lo) * (H - TAU - 1) / (H - TAU - lo) for x in ideal]  # 1, 5/3, 3
    return {m: (round(x), round(x) + TAU) for frag, x in zip(frags, ideal) for m in frag}


def increment(p: int, r: int, step: int, m: str) -> list[float]:
    """The hand-built 'inner steps' of path ``p`` up to ``step`` of round ``r``: a multiple
    of 1/16 per weight, different per path, round, step, module and weight."""
    k = IDS.index(m)
    return [((3 * p + 5 * r + 7 * step + 11 * k + 13 * i) % 9 - 4) / 16 for i in range(N)]


def initial(m: str) -> list[float]:
    return [(IDS.index(m) + i) / 8 for i in range(N)]


Snapshot = tuple[dict[str, list[float]], dict[tuple[int, str], list[float]], dict[str, float]]


def reference(keep: float = KEEP) -> list[Snapshot]:
    """After each round, in float64: θ_global per module, each path's copy, Σα per module."""
    scale = [n / (sum(SHARD_TOKENS) / len(SHARD_TOKENS)) for n in SHARD_TOKENS]
    theta = {m: initial(m) for m in IDS}
    mom = {m: [0.0] * N for m in IDS}
    copy = {(p, m): list(theta[m]) for p in range(4) for m in PATHS[p]}
    since = {(p, m): 0.0 for p in range(4) for m in PATHS[p]}
    out: list[Snapshot] = []
    for r in range(ROUNDS):
        pts = reference_points() if r < ROUNDS - 1 else {m: (H, H) for m in IDS}
        acc = {m: [0.0] * N for m in IDS}
        asum = {m: 0.0 for m in IDS}
        flight: dict[str, tuple[list[float], float]] = {}
        for step in sorted({s for pt in pts.values() for s in pt} | {H}):
            for p in range(4):
                for m in PATHS[p]:
                    copy[(p, m)] = [c + d for c, d in zip(copy[(p, m)], increment(p, r, step, m))]
                    since[(p, m)] += RATE[p] * UNITS[r][step]
                    if pts[m][0] == step:  # contribute α·Δ, Δ = θ_global − copy
                        a = scale[p] * since[(p, m)]
                        acc[m] = [s + a * (t - c) for s, t, c in zip(acc[m], theta[m], copy[(p, m)])]
                        asum[m] += a
                        since[(p, m)] = 0.0

            def land(m: str) -> None:
                total, den = flight.pop(m)
                g = [x / den for x in total]
                mom[m] = [MOMENTUM * b + x for b, x in zip(mom[m], g)]
                theta[m] = [t - LR * (x + MOMENTUM * b) for t, x, b in zip(theta[m], g, mom[m])]
                k = 0.0 if pts[m][0] == pts[m][1] else keep
                for p in range(4):
                    if m in PATHS[p]:
                        copy[(p, m)] = [k * c + (1 - k) * t for c, t in zip(copy[(p, m)], theta[m])]

            for m in IDS:  # modules launched earlier landing now, then launches, then τ = 0 landings
                if pts[m][1] == step and pts[m][0] < step:
                    land(m)
            for m in IDS:
                if pts[m][0] == step:
                    flight[m] = (acc[m], asum[m])
            for m in IDS:
                if pts[m] == (step, step):
                    land(m)
        out.append(({m: list(v) for m, v in theta.items()}, {k: list(v) for k, v in copy.items()}, asum))
    return out


def run_code() -> list[Snapshot]:
    """The same two rounds through RoundDriver (the loop of rounds/loop.py's run_round)."""
    mods = {}
    for m in IDS:
        lin = nn.Linear(N, 1, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.tensor([initial(m)]))
        mods[m] = lin
    topo = Topology(IDS, PATHS, world_size=2)
    sync = DiLoCoSync(topo, mods, outer=dict(name="sgd", lr=LR, momentum=MOMENTUM, nesterov=True),
                      track_cosine=False)
    stream = RoundDriver(sync, streaming_schedule(IDS, H, TAU, fragments=FRAGMENTS), ROUNDS, keep=KEEP)
    alpha = PathAlpha.from_shard_tokens(SHARD_TOKENS)
    out: list[Snapshot] = []
    for r in range(ROUNDS):
        for step in stream.begin_round(r).boundaries():
            for p in stream.paths:
                stream.activate(p)
                with torch.no_grad():
                    for m in PATHS[p]:
                        mods[m].weight.add_(torch.tensor([increment(p, r, step, m)]))
                # a step the reference does not cut at (a wrong schedule) trains one unit
                stream.contribute(p, step, RATE[p] * UNITS[r].get(step, 1), alpha)
            stream.sync_point(step)
        stats = stream.end_round()  # every copy set aside: path_state reads them
        theta = {m: sync.syncs[m].global_weights.detach().double().tolist() for m in IDS}
        copies = {(p, m): stream.path_state(p)[m].double().tolist() for p in stream.paths for m in PATHS[p]}
        out.append((theta, copies, {m: s.alpha_sum for m, s in stats.modules.items()}))
    return out


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= TOL for x, y in zip(a, b))


def test_the_schedule_is_the_equations() -> None:
    got = {m: (pt.launch, pt.land) for m, pt in streaming_schedule(IDS, H, TAU, fragments=FRAGMENTS).points.items()}
    assert got == reference_points() == {
        "embed": (1, 2), "L0.0": (2, 3), "L0.1": (2, 3), "L1.0": (2, 3), "L1.1": (2, 3), "head": (3, 4)}


def test_alpha_differs_within_every_module() -> None:
    """The reference's α are not uniform, so a wrong weighting cannot cancel."""
    scale = PathAlpha.from_shard_tokens(SHARD_TOKENS).scale
    for m in IDS:
        holders = {scale[p] * RATE[p] for p in range(4) if m in PATHS[p]}
        assert len(holders) > 1, m


def test_streaming_rounds_match_the_float64_reference() -> None:
    """After the staggered round and after the synchronous last one: Σα, θ_global and
    every path's copy of every module."""
    for r, ((theta, copies, sums), (want_theta, want_copies, want_sums)) in enumerate(zip(run_code(), reference())):
        where = f"round {r + 1}"
        assert sums.keys() == want_sums.keys() == set(IDS), where
        for m in IDS:
            assert abs(sums[m] - want_sums[m]) <= TOL, f"{where} module {m}: Σα {sums[m]} != {want_sums[m]}"
            assert _close(theta[m], want_theta[m]), f"{where} θ_global of {m}: {theta[m]} != {want_theta[m]}"
        assert copies.keys() == want_copies.keys(), where
        for key, want in want_copies.items():
            assert _close(copies[key], want), f"{where} path {key[0]}'s copy of {key[1]}: {copies[key]} != {want}"
    # the last round is synchronous: every copy lands on θ_global
    theta, copies, _ = reference()[-1]
    assert all(_close(c, theta[m]) for (p, m), c in copies.items())


def test_the_reference_can_tell_the_mix_conventions_apart() -> None:
    """The comparison can fail: with m and 1 − m swapped the reference moves (m ≠ 1/2):
    the copies after the staggered round, and θ_global after the next one."""
    (_, copies, _), (theta, _, _) = reference()
    (_, copies_swapped, _), (theta_swapped, _, _) = reference(keep=1 - KEEP)
    assert all(not _close(copies[k], copies_swapped[k]) for k in copies)
    assert all(not _close(theta[m], theta_swapped[m]) for m in IDS)
