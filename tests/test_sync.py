"""Per-module DiLoCo with the local backend: signs, weights, outer steps, codecs, EF, state."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from _sync_rounds import load_sync_state, sync_round, sync_state, synchronous
from dipaco.plan.codecs import make_codec
from dipaco.sync.comm import LocalComm
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.module_core import pseudo_gradient
from dipaco.sync.outer import make_outer_optimizer
from dipaco.plan.comm_plan import Exchange, chunk_numel, module_exchange, plan_round, reduce_scatter_bytes
from dipaco.plan.topology import Topology

IDS = ["embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"]
PATHS = [["embed", f"L0.{p // 2}", f"L1.{p % 2}", "head"] for p in range(4)]
AVG = dict(name="sgd", lr=1.0, momentum=0.0, nesterov=False)


def const_modules(value: float = 0.0, n: int = 3) -> dict[str, nn.Module]:
    mods = {}
    for m in IDS:
        lin = nn.Linear(n, 1, bias=False)
        with torch.no_grad():
            lin.weight.fill_(value)
        mods[m] = lin
    return mods


def set_path(mods: dict[str, nn.Module], path: list[str], value: float) -> None:
    """Pretend the path trained: its modules' weights become ``value``."""
    with torch.no_grad():
        for m in path:
            mods[m].weight.fill_(value)


def move(mods: dict[str, nn.Module], by: dict[str, Any]) -> None:
    """Pretend the path trained: each module of ``by`` moves by its value (a number or a tensor)."""
    with torch.no_grad():
        for m, d in by.items():
            mods[m].weight.add_(d)


def w(mods: dict[str, nn.Module], m: str) -> float:
    return float(mods[m].weight.detach().mean())


def test_pseudo_gradient_sign() -> None:
    g, p = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 3.0])
    assert torch.equal(pseudo_gradient(g, p), torch.tensor([0.5, -1.0]))
    # with that sign an outer SGD step (lr 0.5) moves θ_global half-way TOWARDS the path
    topo = Topology(IDS, PATHS, world_size=1)
    mods = const_modules(1.0)
    driver = synchronous(DiLoCoSync(topo, mods, outer=dict(name="sgd", lr=0.5, momentum=0.0, nesterov=False)))
    stats = sync_round(driver, 0, lambda p: set_path(mods, PATHS[0], 3.0) or 10, paths=[0])  # moved by +2
    assert w(mods, "L0.0") == pytest.approx(2.0)
    assert stats.modules["L0.0"].pseudo_grad_norm == pytest.approx(2.0 * math.sqrt(3))


def test_alpha_weighting_and_plain_average() -> None:
    topo = Topology(IDS, PATHS, world_size=4)
    mods = const_modules(0.0)
    vals, toks = [1.0, -1.0, 2.0, 5.0], [3, 1, 2, 2]

    def turn(p: int) -> float:
        assert w(mods, "embed") == 0.0  # every path starts the round from θ_global
        set_path(mods, PATHS[p], vals[p])
        return toks[p]

    stats = sync_round(synchronous(DiLoCoSync(topo, mods, outer=AVG)), 0, turn)
    # embed: shared by all 4 paths → token-weighted mean of their weights (exact)
    want = sum(v * t for v, t in zip(vals, toks)) / sum(toks)
    assert w(mods, "embed") == pytest.approx(want, abs=1e-7)
    # L0.0: paths 0 (3 tokens, +1) and 1 (1 token, -1): 3x the tokens pulls 3x harder
    assert w(mods, "L0.0") == pytest.approx((3 * 1.0 + 1 * -1.0) / 4, abs=1e-7)
    assert w(mods, "L1.1") == pytest.approx((1 * -1.0 + 2 * 5.0) / 3, abs=1e-7)
    assert stats.modules["embed"].contributions == 4 and stats.modules["L0.0"].contributions == 2
    assert stats.modules["embed"].alpha_sum == 8.0
    assert stats.modules["embed"].cosine is not None


def test_module_not_in_path_untouched() -> None:
    topo = Topology(IDS, PATHS, world_size=4)
    mods = const_modules(1.0)

    def turn(p: int) -> float:
        with torch.no_grad():  # even if a stray write hits a module outside path 0 ...
            for m in IDS:
                mods[m].weight.fill_(7.0)
        return 5

    stats = sync_round(synchronous(DiLoCoSync(topo, mods, outer=AVG)), 0, turn, paths=[0])
    for m in ["L0.1", "L1.1"]:  # ... it is neither contributed nor kept
        assert w(mods, m) == 1.0 and not stats.modules[m].stepped
        assert stats.modules[m].contributions == 0
    for m in PATHS[0]:
        assert w(mods, m) == 7.0


def test_nesterov_matches_hand_computed_reference() -> None:
    topo = Topology(IDS, PATHS, world_size=1)
    mods = const_modules(0.0, n=1)
    lr, mu = 0.7, 0.9
    driver = synchronous(DiLoCoSync(topo, mods, outer=dict(name="sgd", lr=lr, momentum=mu, nesterov=True)))
    theta, buf = 0.0, None
    for r, target in enumerate([1.0, 2.0, -0.5]):
        sync_round(driver, r, lambda p: set_path(mods, PATHS[p], target) or 1)
        g = theta - target  # Δ = θ_global − θ_path
        buf = g if buf is None else mu * buf + g
        theta = theta - lr * (g + mu * buf)
        assert w(mods, "embed") == pytest.approx(theta, abs=1e-6)


def test_sharing_rescale() -> None:
    topo = Topology(IDS, PATHS, world_size=4)
    mods = const_modules(0.0)
    driver = synchronous(DiLoCoSync(topo, mods, outer=AVG, sharing_rescale=True))
    sync_round(driver, 0, lambda p: set_path(mods, PATHS[p], 1.0) or 1)
    assert w(mods, "embed") == pytest.approx(2.0)  # avg Δ = -1, × √4
    assert w(mods, "L0.0") == pytest.approx(math.sqrt(2))


def test_non_finite_dropped_counted_others_step(caplog: pytest.LogCaptureFixture) -> None:
    topo = Topology(IDS, PATHS, world_size=4)
    mods = const_modules(0.0)
    driver = synchronous(DiLoCoSync(topo, mods, outer=AVG))
    driver.begin_round(0)
    for p in range(4):
        driver.activate(p)
        set_path(mods, PATHS[p], 1.0)
        if p == 1:
            with torch.no_grad():
                mods["L0.0"].weight[0, 0] = float("nan")
        accepted = driver.contribute(p, 1, 1, lambda p, tokens: float(tokens))
        if p == 1:
            assert accepted["L0.0"] is False and accepted["embed"] is True
    assert "path 1" in caplog.text and "L0.0" in caplog.text
    driver.sync_point(1)
    stats = driver.end_round()
    assert stats.modules["L0.0"].dropped == 1 and stats.dropped == 1
    assert stats.modules["L0.0"].contributions == 1
    assert torch.isfinite(mods["L0.0"].weight).all() and w(mods, "L0.0") == pytest.approx(1.0)
    assert w(mods, "embed") == pytest.approx(1.0)


def test_nobody_contributed_leaves_theta() -> None:
    topo = Topology(IDS, PATHS, world_size=1)
    mods = const_modules(0.5)
    stats = sync_round(synchronous(DiLoCoSync(topo, mods)), 0, lambda p: None, paths=[])
    assert all(not s.stepped for s in stats.modules.values())
    assert w(mods, "head") == 0.5


def test_missing_modules_are_reported() -> None:
    topo = Topology(IDS, PATHS, world_size=1)
    with pytest.raises(ValueError, match="must hold modules"):
        DiLoCoSync(topo, {"embed": nn.Linear(1, 1)})


# ----------------------------------------------------------------------------- codecs
def test_codec_registry_errors() -> None:
    with pytest.raises(ValueError, match=r"diloco.codec='zip'.*\['bf16', 'fp16', 'fp8', 'int4', 'int8', 'none', 'topk'\]"):
        make_codec("zip")
    with pytest.raises(ValueError, match="diloco.codec_kw"):
        make_codec("int8", fraction=0.1)


@pytest.mark.parametrize("numel", [1, 255, 1000])
def test_codec_round_trips(numel: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(numel) * 1e-2
    for name, kw in [("none", {}), ("fp16", {}), ("bf16", {}), ("int8", {"block_size": 64}), ("topk", {"fraction": 0.1})]:
        c = make_codec(name, **kw)
        pl = c.encode(x)
        assert c.payload_nbytes(pl) == c.nbytes_for(numel), name
        d = c.decode(pl, numel)
        assert d.shape == x.shape and d.dtype == torch.float32
        if name == "none":
            assert torch.equal(d, x)
        elif name == "fp16":
            assert ((d - x).abs() <= 2**-11 * x.abs() + 2**-24).all()
        elif name == "bf16":
            assert ((d - x).abs() <= 2**-8 * x.abs()).all()
        elif name == "int8":
            b = 64
            for s in range(0, numel, b):
                blk = x[s : s + b]
                assert ((d[s : s + b] - blk).abs() <= blk.abs().max() / 254 + 1e-9).all()
        else:
            k = c.k_for(numel)
            kept = torch.topk(x.abs(), k).indices
            assert torch.equal(d[kept], x[kept])  # exact on kept entries
            assert int((d != 0).sum()) <= k


def test_fp16_clamps_instead_of_inf() -> None:
    c = make_codec("fp16")
    d = c.decode(c.encode(torch.tensor([1e6, -1e6])), 2)
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("lossy_exchange", ["reduce_scatter", "all_gather"])
def test_error_feedback_drives_accumulated_error_to_zero(lossy_exchange: str) -> None:
    topo = Topology(["a"], [["a"], ["a"]], world_size=2)
    torch.manual_seed(0)
    target = torch.randn(2, 50) * 0.01  # each path moves the weights by a fixed step

    def run(ef: bool) -> float:
        lin = nn.Linear(50, 1, bias=False)
        with torch.no_grad():
            lin.weight.zero_()
        driver = synchronous(DiLoCoSync(topo, {"a": lin}, codec="topk", codec_kw={"fraction": 0.1}, error_feedback=ef,
                                        outer=AVG, lossy_exchange=lossy_exchange))
        rounds = 200
        for r in range(rounds):
            sync_round(driver, r, lambda p: move({"a": lin}, {"a": target[p]}) or 1)
        exact = rounds * target.mean(0)
        return float((lin.weight.detach()[0] - exact).norm() / exact.norm())

    with_ef, without = run(True), run(False)
    assert with_ef < 0.05, with_ef
    assert without > 0.5, without


# ----------------------------------------------------------------------------- two-phase exchange
def _chunked(codec: Any, ex: Exchange, x: torch.Tensor, G: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """What CollectiveModuleSync sends: slice r zero-padded to k·c and encoded chunk by chunk."""
    s, c = ex.slice_numel, ex.chunk_numel
    out = []
    for r in range(G):
        sl = torch.cat([x[r * s : (r + 1) * s], x.new_zeros(ex.padded_slice_numel - s)])
        out.append([codec.encode(sl[j * c : (j + 1) * c]) for j in range(ex.num_chunks)])
    return out


def _padded_chunks(x: torch.Tensor, ex: Exchange, r: int) -> list[torch.Tensor]:
    s, c = ex.slice_numel, ex.chunk_numel
    sl = torch.cat([x[r * s : (r + 1) * s], x.new_zeros(ex.padded_slice_numel - s)])
    return [sl[j * c : (j + 1) * c] for j in range(ex.num_chunks)]


@pytest.mark.parametrize("group_size", [1, 2])
def test_two_phase_int8_is_the_ordered_sum_reencoded(group_size: int) -> None:
    """int8: the two-phase result is exactly the all-gather (ordered-sum) result passed once
    more through the codec per chunk, so it is within absmax(block)/254 of it."""
    G, n, block = group_size, 1000, 16
    topo = Topology(["a"], [["a"]] * 4, world_size=4 * G, group_size=G)  # k = 4 worker groups
    codec = make_codec("int8", block_size=block)
    ex = module_exchange(topo, "a", n, codec)
    ag_ex = module_exchange(topo, "a", n, codec, "all_gather")
    assert ex.kind == "reduce_scatter" and ex.num_chunks == 4 and ag_ex.kind == "all_gather"
    assert ex.chunk_numel % block == 0 and ex.chunk_numel == chunk_numel(ex.slice_numel, 4, block)
    torch.manual_seed(0)
    xs = {g: torch.randn(G * ex.slice_numel) * (g + 1) for g in range(4)}
    rs, rs_bytes = LocalComm(topo).exchange("a", {g: _chunked(codec, ex, x, G) for g, x in xs.items()}, codec, ex)
    ag, ag_bytes = LocalComm(topo, "all_gather").exchange(
        "a", {g: _chunked(codec, ag_ex, x, G) for g, x in xs.items()}, codec, ag_ex
    )
    assert rs.shape == ag.shape == (G * ex.slice_numel,)
    for r in range(G):
        want = torch.cat([codec.decode(codec.encode(ch), ex.chunk_numel) for ch in _padded_chunks(ag, ex, r)])
        got = rs[r * ex.slice_numel : (r + 1) * ex.slice_numel]
        assert torch.equal(got, want[: ex.slice_numel])
        ref = torch.cat(_padded_chunks(ag, ex, r)).view(-1, block)  # the codec's stated bound, per block
        err = (torch.cat(_padded_chunks(rs, ex, r)).view(-1, block) - ref).abs()
        assert (err <= ref.abs().amax(1, keepdim=True) / 254 + 1e-6).all()
    # bytes: every one of the k·G ranks sends 2·(k−1) encoded chunks, ~2/k of the all-gather
    assert rs_bytes.cross == 4 * G * reduce_scatter_bytes(4, codec.nbytes_for(ex.chunk_numel)) == 4 * G * ex.cross_bytes
    assert rs_bytes.intra == ag_bytes.intra and rs_bytes.cross < ag_bytes.cross


def test_two_phase_topk_keeps_the_largest_reduced_entries_and_feeds_back() -> None:
    """topk: chunk j of the result holds the k_for(c) largest entries of the ordered sum of
    the decoded contributions to chunk j, exactly; the owner residual keeps the rest."""
    G, n = 2, 301
    topo = Topology(["a"], [["a"]] * 3, world_size=3 * G, group_size=G)  # k = 3
    codec = make_codec("topk", fraction=0.1)
    ex = module_exchange(topo, "a", n, codec)
    c = ex.chunk_numel
    assert ex.kind == "reduce_scatter" and c == chunk_numel(ex.slice_numel, 3)  # topk: no alignment
    torch.manual_seed(1)
    xs = {g: torch.randn(G * ex.slice_numel) for g in range(3)}
    payloads = {g: _chunked(codec, ex, x, G) for g, x in xs.items()}
    owner = {g: torch.zeros(G * c) for g in range(3)}
    out, _ = LocalComm(topo).exchange("a", payloads, codec, ex, owner)
    for r in range(G):
        got = torch.cat([out[r * ex.slice_numel : (r + 1) * ex.slice_numel], torch.zeros(3 * c - ex.slice_numel)])
        for j in range(3):
            ref = torch.zeros(c)
            for g in range(3):  # ascending worker-group order
                ref += codec.decode(payloads[g][r][j], c)
            chunk = got[j * c : (j + 1) * c]
            kept = set(torch.topk(ref.abs(), codec.k_for(c)).indices.tolist())
            assert set(chunk.nonzero().flatten().tolist()) <= kept
            idx = sorted(kept)
            assert torch.equal(chunk[idx][chunk[idx] != 0], ref[idx][chunk[idx] != 0])
            assert torch.equal(owner[j][r * c : (r + 1) * c], ref - chunk)  # chunk j is owned by group j


def test_int8_chunks_are_block_aligned() -> None:
    """Encoding a slice chunk by chunk gives the whole slice's block scales (no straddling)."""
    topo = Topology(["a"], [["a"]] * 4, world_size=4)
    codec = make_codec("int8", block_size=16)
    ex = module_exchange(topo, "a", 1000, codec)
    assert ex.chunk_numel == 256 and ex.padded_slice_numel == 1024
    x = torch.randn(1000)
    padded = torch.cat([x, x.new_zeros(24)])
    whole = codec.encode(padded)
    parts = _chunked(codec, ex, x, 1)[0]
    assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])


def test_two_phase_sync_close_to_all_gather_and_exact() -> None:
    """End to end (outer steps): reduce_scatter vs all_gather vs fp32, int8 block 16."""
    topo = Topology(IDS, PATHS, world_size=4)
    torch.manual_seed(3)
    moves = {p: {m: torch.randn(5, 7) * 0.01 for m in PATHS[p]} for p in range(4)}

    def run(codec: str, lossy_exchange: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        mods = {m: nn.Linear(7, 5, bias=False) for m in IDS}
        sync = DiLoCoSync(topo, mods, codec=codec, codec_kw={"block_size": 16} if codec == "int8" else {},
                          outer=AVG, lossy_exchange=lossy_exchange)
        sync_round(synchronous(sync), 0, lambda p: move(mods, moves[p]) or p + 1)
        return {m: mods[m].weight.detach().clone() for m in IDS}

    exact, ag, rs = run("none", "reduce_scatter"), run("int8", "all_gather"), run("int8", "reduce_scatter")
    for m in IDS:
        # each encoding errs by ≤ absmax(block)/254 of a weighted mean of moves: ≤ biggest/254
        big = max(float(moves[p][m].abs().max()) for p in range(4) if m in PATHS[p])
        assert (ag[m] - exact[m]).abs().max() <= big / 254 + 1e-7, m  # one encoding
        assert (rs[m] - exact[m]).abs().max() <= 2 * big / 254 + 1e-7, m  # two encodings
    with pytest.raises(ValueError, match="lossy_exchange"):
        DiLoCoSync(topo, const_modules(), codec="int8", lossy_exchange="ring")


# ----------------------------------------------------------------------------- bytes and state
@pytest.mark.parametrize("group_size", [1, 2])
@pytest.mark.parametrize("codec, kw", [("none", {}), ("int8", {"block_size": 16}), ("topk", {"fraction": 0.2})])
def test_plan_matches_measured_bytes(group_size: int, codec: str, kw: dict) -> None:
    topo = Topology(IDS, PATHS, world_size=4, group_size=group_size)
    torch.manual_seed(0)
    mods = {m: nn.Linear(7, 5) for m in IDS}  # 40 params: not a multiple of G or blocks
    sync = DiLoCoSync(topo, mods, codec=codec, codec_kw=kw)
    stats = sync_round(synchronous(sync), 0, lambda p: move(mods, {m: 0.1 for m in PATHS[p]}) or 1)
    plan = plan_round(topo, {m: s.numel for m, s in sync.syncs.items()}, sync.codec, 5, sync.lossy_exchange)
    for row in plan.modules:
        assert stats.modules[row.module_id].bytes_sent == row.bytes_total, row.module_id
    assert stats.bytes_sent == plan.bytes_per_round


def test_state_dict_resume_equals_uninterrupted() -> None:
    topo = Topology(IDS, PATHS, world_size=2)

    def round_(sync: DiLoCoSync, mods: dict, r: int) -> None:
        sync_round(synchronous(sync), r, lambda p: move(mods, {m: 0.01 * (p + 1) * (r + 1) for m in PATHS[p]}) or p + 1)

    def fresh() -> tuple[DiLoCoSync, dict]:
        torch.manual_seed(1)
        mods = {m: nn.Linear(6, 6) for m in IDS}
        # the two-phase exchange: its owner residuals must survive the resume too
        return DiLoCoSync(topo, mods, codec="int8", codec_kw={"block_size": 8}, error_feedback=True,
                          lossy_exchange="reduce_scatter"), mods

    a, ma = fresh()
    for r in range(4):
        round_(a, ma, r)
    b, mb = fresh()
    for r in range(2):
        round_(b, mb, r)
    state = {k: v.clone() for k, v in sync_state(b).items()}
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert "embed/outer.momentum_buffer" in state and "embed/residual.1" in state
    assert "embed/residual.1.owner" in state  # second-encoding feedback of the two-phase exchange
    c, mc = fresh()
    load_sync_state(c, state)
    assert c.weights_hash() == b.weights_hash()
    for r in range(2, 4):
        round_(c, mc, r)
    for m in IDS:
        assert torch.equal(ma[m].weight, mc[m].weight), m
    assert a.weights_hash() == c.weights_hash()


# ----------------------------------------------------------------------------- outer optimiser
def test_outer_factory() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    opt = make_outer_optimizer(p)
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["nesterov"] and opt.defaults["lr"] == 0.7
    assert isinstance(make_outer_optimizer(p, name="AdamW", lr=1e-3, betas=(0.9, 0.95)), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"diloco.outer.name='sdg'.*sgd"):
        make_outer_optimizer(p, name="sdg")
    with pytest.raises(ValueError, match="nesterov=true needs diloco.outer.momentum > 0"):
        make_outer_optimizer(p, momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="not accepted"):
        make_outer_optimizer(p, name="sgd", betas=(0.9, 0.9))
    with pytest.raises(ValueError, match="lr"):
        make_outer_optimizer(p, lr=0)


def test_with_the_real_module_grid() -> None:
    """Topology.from_grid and DiLoCoSync accept modules.ModuleGrid (tied embeddings too)."""
    grid_mod = pytest.importorskip("modules.grid")
    cfg_mod = pytest.importorskip("modules.config")
    cfg = cfg_mod.ModelConfig(vocab_size=64, d_model=16, n_heads=2, max_seq_len=16, tie_embeddings=True)
    grid = grid_mod.ModuleGrid(cfg, [2, 2], seed=0)
    topo = Topology.from_grid(grid, world_size=2, group_size=1)
    assert topo.num_paths == 4 and topo.paths_of_group(1) == [1, 3]
    mods = {m: grid.module(m) for m in topo.module_ids}
    sync = DiLoCoSync(topo, mods, outer=AVG)
    sync.check_identical_start()
    stats = sync_round(synchronous(sync), 0, lambda p: 10)
    assert stats.modules["embed"].contributions == 4
    plan = plan_round(topo, {m: grid.param_count(m) for m in topo.module_ids}, make_codec("none"), inner_steps=50)
    assert plan.bytes_per_round == stats.bytes_sent


def test_shared_parameter_between_modules_rejected() -> None:
    topo = Topology(IDS, PATHS, world_size=1)
    mods = const_modules()
    mods["head"].weight = mods["embed"].weight
    with pytest.raises(ValueError, match="share a parameter"):
        DiLoCoSync(topo, mods)


# --------------------------------------------------------------------------- where the outer state lives


def _rounds_on(device: str, outer_device: str, codec: str = "none") -> tuple[DiLoCoSync, dict[str, nn.Module]]:
    """Three rounds of Nesterov over the 2x2 grid, the paths moving to uneven targets."""
    topo = Topology(IDS, PATHS, world_size=1)
    mods = {m: lin.to(device) for m, lin in const_modules(0.0, n=5).items()}
    sync = DiLoCoSync(topo, mods, outer=dict(name="sgd", lr=0.7, momentum=0.9, nesterov=True),
                      outer_device=outer_device, codec=codec)
    driver = synchronous(sync)
    for r, target in enumerate([1.0, 2.0, -0.5]):
        sync_round(driver, r, lambda p: set_path(mods, PATHS[p], target + 0.25 * p) or 1 + p + r)
    return sync, mods


def test_outer_state_stays_on_the_cpu_for_cpu_modules_and_lossy_codecs() -> None:
    """auto = the modules' device; a lossy codec's residuals and the CPU keep it on the CPU."""
    for outer_device, codec in [("auto", "none"), ("cpu", "none"), ("auto", "int8")]:
        sync, _ = _rounds_on("cpu", outer_device, codec)
        assert all(s.global_weights.device.type == "cpu" for s in sync.syncs.values())
    with pytest.raises(ValueError, match="diloco.outer_device='gpu' must be one of auto, cpu"):
        DiLoCoSync(Topology(IDS, PATHS, world_size=1), const_modules(), outer_device="gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_outer_state_on_the_gpu_gives_the_rounds_of_the_cpu_state() -> None:
    """diloco.outer_device=auto on a GPU: θ_global, momentum and Σα·Δ on the GPU, same numbers,
    and a checkpoint written from it loads into a CPU-state sync (and back)."""
    on_gpu, gpu_mods = _rounds_on("cuda", "auto")
    on_cpu, cpu_mods = _rounds_on("cuda", "cpu")
    for m in IDS:
        assert on_gpu.syncs[m].global_weights.device.type == "cuda"
        assert on_cpu.syncs[m].global_weights.device.type == "cpu"
        torch.testing.assert_close(gpu_mods[m].weight.cpu(), cpu_mods[m].weight.cpu(), atol=1e-6, rtol=1e-6)
        state = on_gpu.syncs[m].state_dict()
        on_cpu.syncs[m].load_state_dict(state)
        assert torch.equal(on_cpu.syncs[m].global_weights.detach(), state["global"].cpu())
        on_gpu.syncs[m].load_state_dict(on_cpu.syncs[m].state_dict())
        sync = on_gpu.syncs[m]
        assert sync.outer_optimizer.state[sync.global_weights]["momentum_buffer"].device.type == "cuda"


def test_the_cosine_is_the_mean_over_pairs_without_keeping_the_deltas() -> None:
    """The round's cosine equals the mean pairwise cosine_similarity of the accepted Δs
    (a zero Δ included, a non-finite one dropped), and no Δ is held after it was added."""
    import weakref

    from dipaco.sync.module_core import Contributions

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(50, generator=gen)
    deltas = [base + 0.7 * torch.randn(50, generator=gen) for _ in range(6)] + [torch.zeros(50)]
    c = Contributions([0], 50, torch.device("cpu"), track_cosine=True)
    assert c.cosine() is None
    refs = []
    for d in deltas:
        kept = d.clone()
        refs.append(weakref.ref(kept))
        c.add(0, kept, 1.0, True)
        del kept
    c.add(0, torch.full((50,), float("nan")), 1.0, False)  # dropped: not in the cosine
    assert all(r() is None for r in refs)
    pairs = [float(torch.nn.functional.cosine_similarity(deltas[i], deltas[j], dim=0, eps=1e-12))
             for i in range(len(deltas)) for j in range(i + 1, len(deltas))]
    want = sum(pairs) / len(pairs)
    assert 0.2 < want < 0.9  # a case where the mean is neither 0 nor 1
    assert c.cosine() == pytest.approx(want, abs=1e-6)
    one = Contributions([0], 50, torch.device("cpu"), track_cosine=True)
    one.add(0, deltas[0], 1.0, True)
    assert one.cosine() is None  # one Δ has no pair


def test_tallying_the_cosine_reads_nothing_back_from_the_device(monkeypatch) -> None:
    """A contribution's cosine tally stays on the device (on a GPU a read would wait for it,
    once per path, module and round): no tensor becomes a Python number while Δs are added."""
    from dipaco.sync.module_core import Contributions

    c = Contributions([0, 1], 40, torch.device("cpu"), track_cosine=True)
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(40, generator=gen) for _ in range(3)] + [torch.zeros(40)]

    def no_read(*_):
        raise AssertionError("a tensor was read to the host while tallying")

    with monkeypatch.context() as m:
        for name in ("__float__", "__bool__", "item", "tolist"):
            m.setattr(torch.Tensor, name, no_read)
        for i, d in enumerate(deltas):
            c.add(i % 2, d, 1.0, True)
    pairs = [float(torch.nn.functional.cosine_similarity(deltas[i], deltas[j], dim=0, eps=1e-12))
             for i in range(4) for j in range(i + 1, 4)]
    assert c.cosine() == pytest.approx(sum(pairs) / len(pairs), abs=1e-6)
