"""Both sync modes on the same inputs: one per-module core, one merge.

With every sharing path present and fresh (full quorum, staleness 0), a decoupled outer
step must equal the synchronous one for unequal α, any arrival order, the √P rescale and
any outer optimiser; with a lossy codec (and error feedback) bit for bit where the
synchronous exchange encodes each contribution once (``lossy_exchange=all_gather``, or
``auto`` where it picks all_gather): the two-phase exchange re-encodes the reduced chunks,
a second codec error that decoupled mode, which has no collective to save bytes on, does
not make. The per-module state of one mode loads into the other (the default decoupled
optimiser too); error-feedback residuals survive a round without contributions; a path's
late alternative phase lands where its group would have, whatever the timing.
"""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from _sync_rounds import sync_round, synchronous
from dipaco.runtime import faults
from dipaco.storage.tensor_io import load_state, save_state
from dipaco.config import ConfigError, DiLoCoConfig, to_config
from dipaco.config.decoupled import DecoupledConfig
from dipaco.decoupled.merge import MergingModuleSync, Update
from dipaco.decoupled.service import read_update
from dipaco.decoupled.store import encode_state
from dipaco.decoupled.worker import encode_contribution
from dipaco.plan.comm_plan import module_exchange
from dipaco.plan.codecs import make_codec
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.module_core import ModuleCore, flatten_params, pseudo_gradient
from dipaco.sync.outer import outer_options
from dipaco.plan.topology import Topology
from dipaco.config.validate import validate_config

NUMEL = 512  # a multiple of the int8 block: no padding in either mode
IDS = ["s", "q0", "q1", "q2"]  # "s" is shared by the three paths, "q<p>" is path p's own
PATHS = [["s", f"q{p}"] for p in range(3)]
NESTEROV = {"name": "sgd", "lr": 0.7, "momentum": 0.9, "nesterov": True}
ADAMW = {"name": "adamw", "lr": 0.05, "betas": (0.9, 0.95)}
FULL = DecoupledConfig(quorum=1.0, momentum_every=1)


def _modules(seed: int = 0) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    return {m: nn.Linear(NUMEL, 1, bias=False) for m in IDS}


def _moved(base: torch.Tensor, r: int, p: int, m: str) -> torch.Tensor:
    """θ_path after path p's inner steps in round r: θ_base + a fixed, seeded move."""
    g = torch.Generator().manual_seed(1000 * r + 10 * p + IDS.index(m))
    return base + 0.01 * torch.randn(base.numel(), generator=g)


def _alpha(r: int, p: int) -> float:
    return float([300, 100, 50, 170][(r + p) % 4])  # unequal, and different every round


def _run_sync(rounds: int, codec: str, codec_kw: dict, outer: dict, rescale: bool,
              lossy_exchange: str = "all_gather") -> dict[str, torch.Tensor]:
    mods = _modules()
    topo = Topology(IDS, PATHS, world_size=3)  # each path its own worker group
    sync = DiLoCoSync(topo, mods, codec=codec, codec_kw=codec_kw, error_feedback=True, outer=outer,
                      sharing_rescale=rescale, lossy_exchange=lossy_exchange)
    driver = synchronous(sync)
    for r in range(rounds):

        def turn(p: int) -> float:
            for m in PATHS[p]:
                moved = _moved(sync.syncs[m].global_weights.detach(), r, p, m)
                with torch.no_grad():
                    mods[m].weight.copy_(moved.view_as(mods[m].weight))
            return _alpha(r, p)

        sync_round(driver, r, turn)
    return {m: s.global_weights.detach().clone() for m, s in sync.syncs.items()}


def _run_decoupled(rounds: int, codec: str, codec_kw: dict, outer: dict, rescale: bool,
                   orders: list[tuple[int, ...]]) -> dict[str, MergingModuleSync]:
    mods = _modules()
    syncs = {m: MergingModuleSync(m, flatten_params(list(mods[m].parameters())),
                                   [p for p in range(3) if m in PATHS[p]], FULL, outer, sharing_rescale=rescale)
             for m in IDS}
    lossy = make_codec(codec, **codec_kw)
    residuals: dict[tuple[int, str], torch.Tensor] = {}
    for r in range(rounds):
        updates = []
        for p in range(3):  # every worker pulls version r, trains, pushes (in path order)
            for m in PATHS[p]:
                base = syncs[m].theta.clone()
                delta = pseudo_gradient(base, _moved(base, r, p, m))
                shared = m == "s"  # the worker's rule: a path-private module goes exact
                codec_m = lossy if shared else make_codec("none")
                res = residuals.get((p, m), torch.zeros(NUMEL)) if shared and lossy.lossy else None
                payload, res = encode_contribution(delta, _alpha(r, p), codec_m, res)
                if res is not None:
                    residuals[(p, m)] = res
                meta = {"update_id": f"{m}.p{p}.r{r}", "module_id": m, "path_id": p, "phase": r,
                        "base_version": syncs[m].version, "tokens": _alpha(r, p), "codec": codec_m.name,
                        "codec_kw": codec_kw if codec_m.lossy else {}, "numel": NUMEL, "weighted": True}
                updates.append((p, read_update(encode_state({"payload": list(payload)}, meta))))
        rank = {p: i for i, p in enumerate(orders[r % len(orders)])}  # the arrival order
        for _, u in sorted(updates, key=lambda x: rank[x[0]]):
            assert syncs[u.module_id].offer(u, 0.0) is None
        for m, s in syncs.items():
            assert s.due(0.0) == "quorum"
            assert s.step(0.0) is not None
    return syncs


def compose_config(overrides: list[str]):
    """The schema's defaults with dotted overrides (no Hydra: milliseconds, not a second)."""
    return to_config(OmegaConf.from_dotlist(overrides))


CASES = [("none", {}, NESTEROV, False), ("int8", {"block_size": 256}, NESTEROV, True),
         ("topk", {"fraction": 0.1}, NESTEROV, True), ("int8", {"block_size": 256}, ADAMW, True),
         ("bf16", {}, ADAMW, False)]


@pytest.mark.parametrize("codec,codec_kw,outer,rescale", CASES)
def test_full_quorum_decoupled_equals_sync(codec: str, codec_kw: dict, outer: dict, rescale: bool) -> None:
    rounds = 4
    want = _run_sync(rounds, codec, codec_kw, outer, rescale)
    perms = list(itertools.permutations(range(3)))
    for orders in (perms[:4], perms[2:]):  # two different arrival orders per round
        got = _run_decoupled(rounds, codec, codec_kw, outer, rescale, orders)
        for m in IDS:
            torch.testing.assert_close(got[m].theta, want[m], rtol=0, atol=0, msg=f"module {m}")
            assert got[m].version == rounds


@pytest.mark.parametrize("codec,codec_kw", [("topk", {"fraction": 0.1}), ("none", {})])
def test_the_lossy_equivalence_holds_where_sync_encodes_once(codec: str, codec_kw: dict) -> None:
    """The condition of the bit-for-bit equality, shown at the default ``auto``: top-k 10%
    over the 3 worker groups of "s" picks the two-phase exchange (fewer bytes), whose
    second encoding moves sync mode away from decoupled mode; codec none is exact."""
    topo = Topology(IDS, PATHS, world_size=3)
    kind = module_exchange(topo, "s", NUMEL, make_codec(codec, **codec_kw), "auto").kind
    auto = _run_sync(4, codec, codec_kw, NESTEROV, False, lossy_exchange="auto")
    dec = _run_decoupled(4, codec, codec_kw, NESTEROV, False, [(0, 1, 2)])
    for m in IDS:
        equal = torch.equal(auto[m], dec[m].theta)
        assert equal == (m != "s" or kind != "reduce_scatter"), (m, kind)
    assert kind == ("reduce_scatter" if codec == "topk" else "all_reduce")
    gap = float((auto["s"] - dec["s"].theta).abs().max())
    assert gap < 0.05 if codec == "topk" else gap == 0.0


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_issue_example_unequal_alpha_is_the_token_weighted_mean(order: tuple[int, int]) -> None:
    """2 paths, quorum 1, lr 1, Δ = 1 each, α = 300 and 100: θ = −1.0 (it was −0.769)."""
    s = MergingModuleSync("m", torch.zeros(1), [0, 1], DecoupledConfig(quorum=1.0),
                           {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    alphas = {0: 300.0, 1: 100.0}
    for p in order:
        s.offer(Update(f"u{p}", "m", p, 0, 0, alphas[p], torch.ones(1)), 0.0)
    s.step(0.0)
    assert float(s.theta[0]) == -1.0


@pytest.mark.parametrize("piled", [1, 3, 6])
def test_one_paths_piled_up_phases_move_the_module_once(piled: int) -> None:
    """A path that ran ahead of its synchroniser pushes phases that each start from the
    same pulled θ (its own pending update cannot be in it): they are alternatives, so a
    step moves the module as far as one of them, not ``piled`` times as far (the sum
    drove a loaded chaos run above its initial loss)."""
    s = MergingModuleSync("m", torch.zeros(1), [0, 1], DecoupledConfig(quorum=1.0),
                           {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    for k in range(piled):  # path 0 alone, every phase from version 0
        s.offer(Update(f"u{k}", "m", 0, k, 0, 100.0, torch.ones(1)), 0.0)
    rec = s.step(0.0, trigger="grace")
    # a partial step (path 1 missing) moves by path 0's share of a round: 1 / 2
    assert float(s.theta[0]) == pytest.approx(-0.5, abs=1e-6)
    assert sorted(rec.update_ids) == [f"u{k}" for k in range(piled)]
    assert rec.weights == pytest.approx([100.0 / piled] * piled)


def test_piled_up_phases_weigh_as_one_contributor_beside_other_paths() -> None:
    """Path 0 with two pending phases (Δ 1 and 3) and path 1 with one (Δ 2), equal α:
    path 0 counts once, with the mean of its two, so θ = −(mean(1, 3) + 2) / 2."""
    s = MergingModuleSync("m", torch.zeros(1), [0, 1], DecoupledConfig(quorum=1.0),
                           {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    s.offer(Update("a", "m", 0, 0, 0, 100.0, torch.full((1,), 1.0)), 0.0)
    s.offer(Update("b", "m", 0, 1, 0, 100.0, torch.full((1,), 3.0)), 0.0)
    s.offer(Update("c", "m", 1, 0, 0, 100.0, torch.full((1,), 2.0)), 0.0)
    s.step(0.0)
    assert float(s.theta[0]) == -2.0


TOY = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False}


def _toy_phase(s: MergingModuleSync, phase: int, base: int, delta: float) -> None:
    assert s.offer(Update(f"u{phase}", "m", 0, phase, base, 1.0, torch.full((1,), delta)), 0.0) is None


@pytest.mark.parametrize("d1,d2", [(-0.9, -0.9), (-0.9, -0.5), (-0.5, -0.9)])
def test_a_late_alternative_lands_where_both_at_once_would(d1: float, d2: float) -> None:
    """The issue's toy: loss (θ − 1)², a phase moves θ 90% of the way, so Δ = −0.9 from
    θ = 0. Two phases from the same base (the second pulled before the first was applied)
    gave θ = 0.900 in one step but 1.536 when the synchroniser stepped between them (past
    the optimum: loss 0.010 → 0.288). Now both timings land on the mean of the two."""
    together = MergingModuleSync("m", torch.zeros(1), [0], DecoupledConfig(quorum=1.0), TOY)
    _toy_phase(together, 0, 0, d1)
    _toy_phase(together, 1, 0, d2)
    together.step(0.0)
    apart = MergingModuleSync("m", torch.zeros(1), [0], DecoupledConfig(quorum=1.0), TOY)
    _toy_phase(apart, 0, 0, d1)
    apart.step(0.0)
    _toy_phase(apart, 1, 0, d2)  # staleness 1: its discount must not change the outcome
    rec = apart.step(0.0)
    want = -(d1 + d2) / 2
    assert float(together.theta[0]) == pytest.approx(want, abs=1e-6)
    assert float(apart.theta[0]) == pytest.approx(want, abs=1e-6)
    assert rec.staleness == [1]
    # the next phase starts from weights holding both: an increment again, as in sync
    # DiLoCo (0.9 → 0.99 on the toy)
    theta = float(apart.theta[0])
    _toy_phase(apart, 2, apart.version, -0.9 * (1 - theta))
    apart.step(0.0)
    assert float(apart.theta[0]) == pytest.approx(theta + 0.9 * (1 - theta), abs=1e-6)
    if d1 == d2:
        assert float(apart.theta[0]) == pytest.approx(0.99, abs=1e-6)


def test_a_synchronous_optimiser_state_loads_into_the_default_decoupled_synchroniser() -> None:
    """A sync checkpoint's outer state is torch SGD's momentum buffer alone; the default
    decoupled optimiser (delayed Nesterov, momentum every 4 steps) raised KeyError 'step'
    on its first step. It now keeps the loaded momentum and applies it at its 4th step."""
    sync = ModuleCore("m", torch.zeros(1), NESTEROV)
    sync.outer_step(torch.full((1,), 2.0))  # θ = −0.7·(2 + 0.9·2) = −2.66, momentum 2
    state = sync.state_dict()
    assert set(state) == {"global", "outer.momentum_buffer"}
    outer = outer_options(DiLoCoConfig(mode="decoupled"))
    assert outer["name"] == "delayed_nesterov" and outer["every"] == 4
    dec = MergingModuleSync("m", torch.zeros(1), [0], DecoupledConfig(quorum=1.0), outer)
    dec.load_state_dict(state)
    applied = []
    for k in range(4):  # each step's outer gradient is 1 (one path, α = 1, Δ = 1)
        dec.offer(Update(f"u{k}", "m", 0, k, dec.version, 1.0, torch.ones(1)), 0.0)
        applied.append(dec.step(0.0).momentum_applied)
    assert applied == [False, False, False, True]
    # three plain steps, then m = 0.9·2 + 4/4 = 2.8 and a Nesterov step −0.7·(1 + 0.9·2.8)
    assert float(dec.theta[0]) == pytest.approx(-2.66 - 3 * 0.7 - 0.7 * (1 + 0.9 * 2.8), abs=1e-5)


def test_decoupled_runs_a_non_sgd_outer_optimiser() -> None:
    s = MergingModuleSync("m", torch.zeros(4), [0, 1], DecoupledConfig(quorum=0.5), ADAMW)
    assert isinstance(s.core.outer_optimizer, torch.optim.AdamW)
    for k in range(3):
        s.offer(Update(f"u{k}", "m", k % 2, k, s.version, 100.0, torch.ones(4)), 0.0)
        assert s.step(0.0) is not None
    assert s.version == 3 and bool((s.theta < 0).all())
    assert "outer.exp_avg" in s.state_dict()


def test_sync_state_loads_into_decoupled_and_back(tmp_path: Path) -> None:
    """outer/<module>.safetensors of a sync checkpoint → a decoupled synchroniser → sync."""
    topo = Topology(IDS, PATHS, world_size=3)
    mods = _modules()
    sync = DiLoCoSync(topo, mods, codec="int8", error_feedback=True, outer=NESTEROV, lossy_exchange="all_gather")
    driver = synchronous(sync)

    def paths_move(r: int, by: list[float], tokens: list[float]) -> None:
        def turn(p: int) -> float:
            with torch.no_grad():
                for m in PATHS[p]:
                    mods[m].weight.add_(by[p])
            return tokens[p]

        sync_round(driver, r, turn)

    paths_move(0, [0.01, 0.02, 0.03], [100.0, 200.0, 300.0])
    save_state(tmp_path / "s.safetensors", sync.syncs["s"].state_dict())
    saved = load_state(tmp_path / "s.safetensors")
    assert {"global", "outer.momentum_buffer", "residual.0"} <= set(saved)

    dec = MergingModuleSync("s", torch.zeros(NUMEL), [0, 1, 2], FULL, NESTEROV)
    dec.load_state_dict(saved)
    assert dec.version == 0 and torch.equal(dec.theta, sync.syncs["s"].global_weights.detach())
    # one more identical step in both modes from the loaded state
    g = torch.full((NUMEL,), 0.02)
    for p in range(3):
        dec.offer(Update(f"u{p}", "s", p, 1, 0, 1.0, g), 0.0)
    dec.step(0.0)
    sync.syncs["s"].error_feedback = False  # compare the optimiser, not the codec
    sync.syncs["s"]._wire_codec = make_codec("none")
    paths_move(1, [-0.02] * 3, [1.0] * 3)
    torch.testing.assert_close(dec.theta, sync.syncs["s"].global_weights.detach(), rtol=0, atol=1e-7)

    save_state(tmp_path / "back.safetensors", {k: v for k, v in dec.state_dict().items() if isinstance(v, torch.Tensor)})
    back = DiLoCoSync(topo, _modules(), outer=NESTEROV)
    back.syncs["s"].load_state_dict(load_state(tmp_path / "back.safetensors"))
    assert torch.equal(back.syncs["s"].global_weights.detach(), dec.theta)
    torch.testing.assert_close(back.syncs["s"].outer_optimizer.state[back.syncs["s"].global_weights]["momentum_buffer"],
                               dec.core.outer_optimizer.state[dec.core.global_weights]["momentum_buffer"])


@pytest.mark.parametrize("exchange", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("nan_paths", [(0, 1), (0,)])
def test_residuals_survive_a_round_without_contributions(nan_paths: tuple[int, ...], exchange: str) -> None:
    topo = Topology(["a"], [["a"], ["a"]], world_size=2)
    lin = nn.Linear(50, 1, bias=False)
    sync = DiLoCoSync(topo, {"a": lin}, codec="topk", codec_kw={"fraction": 0.1}, error_feedback=True,
                      outer=NESTEROV, lossy_exchange=exchange)
    torch.manual_seed(0)

    driver = synchronous(sync)

    def round_(nan: tuple[int, ...]) -> None:
        def turn(p: int) -> float:
            with torch.no_grad():
                lin.weight.add_(torch.randn(1, 50) * 0.01)
                if p in nan:
                    lin.weight[0, 0] = float("nan")
            return 10.0

        sync_round(driver, 0, turn)

    round_(())
    ms = sync.syncs["a"]
    before = {c: r.clone() for c, r in ms.residuals.items()}
    owners = {c: r.clone() for c, r in ms.owner_residuals.items()}
    assert bool(owners) == (exchange == "reduce_scatter")
    theta = ms.global_weights.detach().clone()
    assert all(float(r.abs().sum()) > 0 for r in before.values())
    round_(nan_paths)
    for c in nan_paths:  # no finite contribution: residual kept as it was
        assert torch.equal(ms.residuals[c], before[c]), c
    if len(nan_paths) == 2:  # nothing at all: no step, and the owners' residuals kept too
        assert torch.equal(ms.global_weights.detach(), theta)
        assert all(torch.equal(ms.owner_residuals[c], r) for c, r in owners.items())


@pytest.mark.parametrize("override,key", [
    ("diloco.mode=decoupled diloco.lossy_exchange=reduce_scatter", "diloco.lossy_exchange"),
    ("diloco.mode=decoupled grid.replicas=2", "grid.replicas"),
    ("diloco.mode=sync diloco.decoupled.quorum=1.0", "diloco.decoupled.quorum"),
    ("diloco.mode=sync diloco.decoupled.momentum_every=2", "diloco.decoupled.momentum_every"),
])
def test_options_one_mode_cannot_honour_are_refused(override: str, key: str) -> None:
    cfg = compose_config(override.split())
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.key == key


def test_every_other_diloco_option_is_accepted_in_both_modes() -> None:
    common = ["diloco.codec=int8", "diloco.error_feedback=true", "diloco.sharing_rescale=true",
              "diloco.outer.name=adamw", "diloco.outer.momentum=0", "diloco.outer.nesterov=false",
              "diloco.lossy_exchange=all_gather"]
    validate_config(compose_config(["diloco.mode=decoupled", *common]))
    validate_config(compose_config(["diloco.mode=sync", *common]))
    validate_config(compose_config(["diloco.mode=sync", "diloco.outer.name=delayed_nesterov",
                                    "diloco.decoupled.momentum_every=4"]))


def test_one_fault_mechanism_for_both_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.worker_chaos() == faults.WorkerChaos()
    monkeypatch.setenv(faults.ENV, "nan:path=1:round=2;worker_kill:every_s=1.5:max=4:seed=3;worker_delay:prob=0.5:s=0.8")
    assert faults.worker_chaos() == faults.WorkerChaos(1.5, 4, 0.5, 0.8, 3)
    with pytest.raises(ValueError, match="every_s > 0 and max > 0"):
        faults.parse("worker_kill:every_s=1")
    with pytest.raises(ValueError, match="not a float"):
        faults.parse("worker_delay:prob=x:s=1")
