"""``launcher.group_parallel=fsdp``: FSDP2 inside a worker group (dipaco/sync/fsdp.py,
dipaco/sync/sharded.py).

One spawn of 4 gloo ranks (2 worker groups of 2) trains a tiny [2, 2] grid of real
modules with real path learners three ways (replicated fp32, FSDP fp32, FSDP bf16
autocast); the parent process trains the same grid with the local backend. The fp32
runs must end on the same global weights, the sharded exchange must send only
shard-sized messages (and exactly the planned bytes), and a sharded sync must load a
full checkpoint state by re-sharding it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _sync_rounds import load_sync_state, sync_round, sync_state, synchronous
from dipaco.plan.comm_plan import plan_round, ring_allreduce_bytes
from dipaco.config import ConfigError, TrainerConfig, compose_config
from dipaco.rounds.learner import PathLearner
from dipaco.plan.memory import rank_memory
from dipaco.plan.codecs import make_codec
from dipaco.sync.data_parallel import allreduce_gradients
from dipaco.sync.diloco import DiLoCoSync
from dipaco.sync.fsdp import apply_fsdp, is_sharded, shard_flat, unshard_flat, worker_mesh
from dipaco.sync.groups import ProcessGroups
from dipaco.plan.topology import Topology
from dipaco.job.preflight import preflight  # validate_config, then the checks that ask torch and the machine
from modules import ModelConfig, ModuleGrid, PathModel

MODEL = ModelConfig(vocab_size=64, d_model=16, n_heads=2, layers_per_level=1, max_seq_len=16)
LEVELS, B, T, H, ROUNDS = [2, 2], 4, 8, 2, 2
OUTER = dict(name="sgd", lr=0.7, momentum=0.9, nesterov=True)
MODES = ("replicate", "fsdp", "fsdp_bf16")


class Stream:
    """Deterministic batches of one path; rank ``r`` of ``world`` takes its rows."""

    def __init__(self, path_id: int, rank: int = 0, world: int = 1) -> None:
        self.path_id, self.rank, self.world, self.i = path_id, rank, world, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.path_id + self.i)
        self.i += 1
        toks = torch.randint(0, MODEL.vocab_size, (B, T + 1), generator=g)
        rows = slice(self.rank * B // self.world, (self.rank + 1) * B // self.world)
        return toks[rows, :-1], toks[rows, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, s: dict[str, int]) -> None:
        self.i = int(s["i"])


def topology(world: int, group_size: int) -> Topology:
    grid = ModuleGrid(MODEL, LEVELS)
    return Topology(grid.module_ids, [grid.module_ids_of_path(p) for p in range(grid.num_paths)], world, group_size)


def train(rank: int | None, topo: Topology, pg: Any = None, mode: str = "replicate",
          rounds: int = ROUNDS) -> DiLoCoSync:
    """ROUNDS rounds of the [2, 2] grid as dipaco/rounds/loop.py drives them; returns the sync."""
    grid = ModuleGrid(MODEL, LEVELS, seed=0)
    fsdp = mode.startswith("fsdp")
    G = topo.group_size
    local = 0 if rank is None else topo.local_rank(rank)
    groups = range(topo.num_groups) if rank is None else [topo.group_of_rank(rank)]
    paths = sorted(p for g in groups for p in topo.paths_of_group(g))
    mods = {m: grid.module(m) for m in grid.module_ids if any(m in topo.path_modules[p] for p in paths)}
    wpg = None if rank is None else pg.worker_group(topo.group_of_rank(rank))
    if fsdp:
        apply_fsdp(mods, worker_mesh(wpg, torch.device("cpu")))
    sync = DiLoCoSync(topo, mods, rank=rank, outer=OUTER, process_groups=pg, sharded=fsdp)
    sync.check_identical_start()
    tcfg = TrainerConfig(lr=1e-2, warmup_steps=1, compile=False, precision="bf16" if mode == "fsdp_bf16" else "fp32")
    grad_sync = (lambda ps: allreduce_gradients(ps, wpg, G)) if G > 1 and not fsdp else None
    learners = {p: PathLearner(p, PathModel(grid, p), Stream(p, local, G), tcfg, ROUNDS * H, grad_sync=grad_sync)
                for p in paths}
    sync.driver = synchronous(sync, H)
    for r in range(rounds):
        sync.last_stats = sync_round(sync.driver, r, lambda p: learners[p].train_steps(H).tokens)
    sync.learners = learners
    if fsdp:
        # trainer.compile left to "auto" is on for CUDA; sharded paths must stay eager anyway
        # (validation refuses compile=true with fsdp): ask for it and check nothing compiled
        model = learners[paths[0]].model
        wanted = replace(tcfg, compile=True, compile_backend="eager")
        sync.eager = PathLearner(paths[0], model, Stream(paths[0], local, G), wanted, 1).forward is model
    return sync


def _worker(rank: int, world: int, out: str) -> None:
    topo = topology(world, 2)
    pg = ProcessGroups(topo, rank)
    results: dict[str, Any] = {}
    for mode in MODES:
        sizes: list[int] = []
        sync = train(rank, topo, pg, mode)
        if mode == "fsdp":
            # one more round, counting every all-reduce message of the exchange
            real = dist.all_reduce

            def counting(t: torch.Tensor, *a: Any, **k: Any) -> Any:
                sizes.append(t.numel())
                return real(t, *a, **k)

            dist.all_reduce = counting
            try:
                stats = sync_round(sync.driver, ROUNDS, lambda p: None, paths=[])
            finally:
                dist.all_reduce = real
            results["sizes"] = sizes
            results["shard_numel"] = {m: s.numel for m, s in sync.syncs.items()}
            results["bytes"] = {m: s.bytes_sent for m, s in stats.modules.items()}
            results["trace"] = sync.comm.trace
            counts = {m: ModuleGrid(MODEL, LEVELS).param_count(m) for m in topo.module_ids}
            plan = plan_round(topo, counts, make_codec("none"), H, sharded=True)
            results["plan"] = {m.module_id: m.bytes_per_rank for m in plan.modules if m.module_id in sync.syncs}
            results["masters"] = sorted({str(p.dtype) for s in sync.syncs.values() for p in s.params})
            results["dtensor"] = all(is_sharded(p) for s in sync.syncs.values() for p in s.params)
            results["eager"] = sync.eager
        state = sync_state(sync)  # a collective over the worker group when sharded
        results[mode] = state
        if mode == "fsdp_bf16":
            results["bf16_masters"] = sorted({str(p.dtype) for s in sync.syncs.values() for p in s.params})
            results["bf16_loss"] = [learner.train_steps(1).loss for learner in sync.learners.values()]
        if mode == "fsdp":
            # load a full state by re-sharding: the replicated run's final state
            load_sync_state(sync, results["replicate"])
            results["reloaded"] = {m: s.global_weights.detach().clone() for m, s in sync.syncs.items()}
            results["shapes"] = {m: s.shapes for m, s in sync.syncs.items()}
            # learner state: AdamW moments gathered whole, then re-sharded
            learner = next(iter(sync.learners.values()))
            full = learner.state_dict()
            learner.load_state_dict(full)
            results["adam_roundtrip"] = all(
                torch.equal(v.full_tensor(), full["optimizer"]["state"][i]["exp_avg"])
                for i, s in learner.optimizer.state_dict()["state"].items() for k, v in s.items() if k == "exp_avg")
    # resume with another group size: one worker group of 4 loads the state written by
    # groups of 2 (re-sharded 4 ways), and gathers it back to the same full tensors
    topo4 = topology(world, 4)
    sync4 = train(rank, topo4, ProcessGroups(topo4, rank), "fsdp", rounds=0)
    states: list[Any] = [None] * world
    dist.all_gather_object(states, results["fsdp"])
    merged = {k: v for st in states for k, v in st.items()}  # every module's full state
    load_sync_state(sync4, merged)
    results["merged"], results["regathered"] = merged, sync_state(sync4)
    torch.save(results, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp")
    run_ranks(_worker, world_size=4, args=(str(out),), timeout=120)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.multiprocess
def test_fsdp_group_matches_replicated_group_and_local_backend(ranks: list[dict[str, Any]]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a loaded 2-core host, 2 OpenMP threads take ~50x longer
    try:
        local = sync_state(train(None, topology(2, 1)))
    finally:
        torch.set_num_threads(threads)
    for r in (0, 2):  # local rank 0 of each worker group: its modules' full states
        fsdp, repl = ranks[r]["fsdp"], ranks[r]["replicate"]
        held = [k for k in fsdp if k.endswith("/global")]
        assert held and sorted(held) == sorted(k for k in repl if k.endswith("/global"))
        for k in held:
            torch.testing.assert_close(fsdp[k], repl[k], atol=2e-6, rtol=1e-5, msg=k)
            torch.testing.assert_close(repl[k], local[k], atol=2e-6, rtol=1e-5, msg=k)
            momentum = k.replace("/global", "/outer.momentum_buffer")
            torch.testing.assert_close(fsdp[momentum], repl[momentum], atol=2e-6, rtol=1e-5)
        # both ranks of a group gather the same full state
        assert all(torch.equal(fsdp[k], ranks[r + 1]["fsdp"][k]) for k in held)


@pytest.mark.multiprocess
def test_sharded_exchange_sends_shard_sized_messages_as_planned(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        shard = res["shard_numel"]
        # the Σα·Δ all-reduces carry one shard each; the rest are the 3-float Σα metas
        assert max(res["sizes"]) == max(n for m, n in shard.items() if res["plan"][m] > 0)
        assert sorted(n for n in res["sizes"] if n > 3) == sorted(n for m, n in shard.items() if res["plan"][m] > 0)
        assert res["bytes"] == res["plan"]  # the plan (sharded: no intra-group gather) is what was sent
        exchanges = [t for t in res["trace"] if t[1] != "all_reduce_meta"]
        assert {kind for _, kind, _, _ in exchanges} == {"all_reduce_shard"}  # no all_gather_slices
        for m, _, sub, nbytes in exchanges:
            assert nbytes == ring_allreduce_bytes(len(sub), 4 * shard[m])
        assert res["dtensor"] and res["masters"] == ["torch.float32"]


@pytest.mark.multiprocess
def test_sharded_paths_stay_eager_even_when_compile_is_asked(ranks: list[dict[str, Any]]) -> None:
    assert all(res["eager"] for res in ranks)


@pytest.mark.multiprocess
def test_bf16_autocast_with_fsdp_keeps_fp32_masters(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        assert res["bf16_masters"] == ["torch.float32"]
        assert all(0 < loss < 10 for loss in res["bf16_loss"])
        for k, v in res["fsdp_bf16"].items():
            if k.endswith("/global"):
                assert v.dtype == torch.float32 and bool(torch.isfinite(v).all())
                # bf16 forward: close to the fp32 run, not equal to it
                torch.testing.assert_close(v, res["fsdp"][k], atol=5e-2, rtol=0)


@pytest.mark.multiprocess
def test_sharded_sync_reloads_a_full_state_by_resharding(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        for m, got in res["reloaded"].items():
            full = res["replicate"][f"{m}/global"]
            assert torch.equal(got, shard_flat(full, res["shapes"][m], 2, rank % 2))
        assert res["adam_roundtrip"]


@pytest.mark.multiprocess
def test_state_of_groups_of_two_resumes_in_one_group_of_four(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        merged, back = res["merged"], res["regathered"]
        assert len([k for k in back if k.endswith("/global")]) == 6
        for k, v in back.items():
            if k != "diloco/round":
                assert torch.equal(v, merged[k]), k


def test_shard_layout_round_trips() -> None:
    shapes = [torch.Size([4, 3]), torch.Size([8]), torch.Size([4, 2, 2])]
    full = torch.arange(12 + 8 + 16, dtype=torch.float32)
    for G in (1, 2, 4):
        shards = [shard_flat(full, shapes, G, r) for r in range(G)]
        assert all(s.numel() == full.numel() // G for s in shards)
        assert torch.equal(unshard_flat(shards, shapes), full)
    # shard r holds rows r of each parameter, in parameter order
    assert shard_flat(full, shapes, 2, 1)[:6].tolist() == list(range(6, 12))


def test_plan_and_memory_under_fsdp() -> None:
    topo = topology(4, 2)
    counts = {m: 1000 for m in topo.module_ids}
    none = make_codec("none")
    repl = plan_round(topo, counts, none, H)
    shard = plan_round(topo, counts, none, H, sharded=True)
    for a, b in zip(repl.modules, shard.modules):
        if a.bytes_per_rank:
            # sharded: the same cross and meta bytes, no all-gather of 500 fp32 inside the group
            assert a.bytes_per_rank - b.bytes_per_rank == 500 * 4
    m1 = rank_memory(MODEL, 2, 4000, [3000, 3000], sequences=2, seq_len=T)
    m2 = rank_memory(MODEL, 2, 4000, [3000, 3000], sequences=2, seq_len=T, shards=2, gathered_params=1000)
    assert m2.optimizer * 2 == m1.optimizer and m2.gradients * 2 == m1.gradients
    assert m2.parameters == 4 * (2000 + 1000) and m2.outer * 2 == m1.outer


@pytest.mark.parametrize("overrides,key", [
    (["launcher=spawn", "launcher.group_size=1"], "launcher.group_parallel"),
    (["launcher=local"], "launcher.group_parallel"),
    (["launcher=spawn", "launcher.group_size=2", "model.tie_embeddings=true"], "launcher.group_parallel"),
    (["launcher=spawn", "launcher.group_size=2", "diloco.codec=int8"], "launcher.group_parallel"),
    (["launcher=spawn", "launcher.group_size=2", "diloco.mode=decoupled"], "launcher.group_parallel"),
    (["launcher=spawn", "launcher.nproc=6", "launcher.group_size=3", "trainer.batch_size=6"],
     "launcher.group_size"),
    (["launcher=spawn", "launcher.group_parallel=zero3"], "launcher.group_parallel"),
])
def test_fsdp_refusals_name_the_key(overrides: list[str], key: str) -> None:
    extra = [] if any(o.startswith("launcher.group_parallel") for o in overrides) else ["launcher.group_parallel=fsdp"]
    cfg = compose_config(["model=tiny", "trainer=tiny", *overrides, *extra])
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert err.value.key == key, str(err.value)


def test_fsdp_config_is_valid() -> None:
    preflight(compose_config(["model=tiny", "trainer=tiny", "launcher=spawn", "launcher.group_size=2",
                                    "launcher.group_parallel=fsdp", "trainer.precision=bf16"]))
