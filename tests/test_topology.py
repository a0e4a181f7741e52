"""Topology: validation messages, static round-robin dealing, module groups, planning."""
from __future__ import annotations

import pytest

from dipaco.plan.comm_plan import (
    META_BYTES,
    allgather_bytes,
    chunk_numel,
    format_plan,
    plan_round,
    reduce_scatter_bytes,
    ring_allreduce_bytes,
)
from dipaco.plan.codecs import make_codec
from dipaco.plan.topology import Topology

IDS = ["embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"]


def grid_paths(k0: int = 2, k1: int = 2) -> list[list[str]]:
    ids = []
    for p in range(k0 * k1):
        ids.append(["embed", f"L0.{p // k1}", f"L1.{p % k1}", "head"])
    return ids


class FakeGrid:
    module_ids = IDS
    num_paths = 4

    def module_ids_of_path(self, p: int) -> list[str]:
        return grid_paths()[p]


def test_from_grid_and_basic_answers() -> None:
    t = Topology.from_grid(FakeGrid(), world_size=4, group_size=1)
    assert t.num_paths == 4 and t.num_groups == 4
    assert [t.paths_of_group(g) for g in range(4)] == [[0], [1], [2], [3]]
    assert t.modules_of_group(1) == ["embed", "L0.0", "L1.1", "head"]
    assert t.groups_of_module("L0.0") == [0, 1]
    assert t.groups_of_module("L1.0") == [0, 2]
    assert t.groups_of_module("embed") == [0, 1, 2, 3]
    assert t.module_ranks("L0.1") == [2, 3]


def test_worker_groups_of_two_ranks() -> None:
    t = Topology(IDS, grid_paths(), world_size=4, group_size=2)
    assert t.num_groups == 2
    assert t.ranks_of_group(1) == [2, 3]
    assert t.group_of_rank(3) == 1 and t.local_rank(3) == 1
    # static round-robin: p % num_groups
    assert t.paths_of_group(0) == [0, 2] and t.paths_of_group(1) == [1, 3]
    assert t.modules_of_group(0) == ["embed", "L0.0", "L0.1", "L1.0", "head"]
    assert t.groups_of_module("L1.0") == [0]
    assert t.groups_of_module("L0.0") == [0, 1]
    assert t.module_ranks("L0.0") == [0, 1, 2, 3]
    assert t.module_subgroup_ranks("L0.0", 1) == [1, 3]
    assert t.module_subgroup_ranks("L1.1", 0) == [2]


def test_more_paths_than_groups_none_dropped() -> None:
    paths = grid_paths(3, 3)  # 9 paths
    ids = ["embed"] + [f"L{l}.{k}" for l in range(2) for k in range(3)] + ["head"]
    t = Topology(ids, paths, world_size=2, group_size=1)
    dealt = sorted(p for g in range(t.num_groups) for p in t.paths_of_group(g))
    assert dealt == list(range(9))
    assert t.paths_of_group(0) == [0, 2, 4, 6, 8] and t.paths_of_group(1) == [1, 3, 5, 7]
    for p in range(9):
        assert p in t.paths_of_group(t.group_of_path(p))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=5, group_size=2), ["launcher.nproc=5", "launcher.group_size=2", "multiple"]),
        (dict(world_size=8, group_size=1), ["8 worker groups", "only 4 paths", "idle", "launcher.nproc"]),
        (dict(world_size=4, group_size=0), ["launcher.group_size"]),
    ],
)
def test_validation_messages(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        Topology(IDS, grid_paths(), **kwargs)
    for w in words:
        assert w in str(e.value)


def test_validation_no_paths_and_unknown_module() -> None:
    with pytest.raises(ValueError, match="no paths.*grid.levels"):
        Topology(IDS, [], world_size=1)
    bad = grid_paths()
    bad[3] = ["embed", "L0.1", "L2.0", "head"]
    with pytest.raises(ValueError, match=r"path 3 uses module 'L2.0'"):
        Topology(IDS, bad, world_size=1)
    with pytest.raises(ValueError, match="in no path"):
        Topology(IDS + ["L9.9"], grid_paths(), world_size=1)


def test_byte_formulas() -> None:
    assert ring_allreduce_bytes(1, 100) == 0
    assert ring_allreduce_bytes(2, 100) == 100
    assert ring_allreduce_bytes(4, 400) == 600
    assert allgather_bytes(4, 10) == 30
    assert reduce_scatter_bytes(1, 100) == 0
    assert reduce_scatter_bytes(4, 100) == 600  # 3 chunks out in phase 1, own chunk to 3 in phase 2
    # chunks: ceil(s/k) rounded up to the codec alignment (int8 block)
    assert chunk_numel(1000, 4) == 250 and chunk_numel(1001, 4) == 251
    assert chunk_numel(1000, 4, 64) == 256 and chunk_numel(10, 4, 16) == 16 and chunk_numel(0, 4, 16) == 0


def test_plan_none_and_int8() -> None:
    t = Topology(IDS, grid_paths(), world_size=4, group_size=2)
    counts = {m: 1000 for m in IDS}
    plan = plan_round(t, counts, make_codec("none"), inner_steps=10)
    rows = {r.module_id: r for r in plan.modules}
    # L1.0 is held by worker group 0 only: nothing crosses
    assert rows["L1.0"].bytes_total == 0 and rows["L1.0"].groups == (0,)
    # L0.0: 2 groups, G=2 → slices of 500 floats; ring all-reduce over 2, meta, intra all-gather
    per_rank = ring_allreduce_bytes(2, 4 * 500) + ring_allreduce_bytes(2, META_BYTES) + allgather_bytes(2, 4 * 500)
    assert rows["L0.0"].bytes_per_rank == per_rank and rows["L0.0"].bytes_total == 4 * per_rank
    assert rows["embed"].sharers == (0, 1, 2, 3)
    # DDP: every inner step all-reduces a 4000-param path over 4 ranks
    assert plan.ddp_bytes_per_round == 4 * 10 * ring_allreduce_bytes(4, 4 * 4000)
    assert plan.bytes_per_round < plan.ddp_bytes_per_round
    meta_intra = ring_allreduce_bytes(2, META_BYTES) + allgather_bytes(2, 2000)
    ag = plan_round(t, counts, make_codec("int8", block_size=100), inner_steps=10, lossy_exchange="all_gather")
    rag = {r.module_id: r for r in ag.modules}
    assert rag["L0.0"].bytes_per_rank == allgather_bytes(2, 500 + 4 * 5) + meta_intra
    assert rag["L0.0"].exchange == "all_gather" and ag.lossy_exchange == "all_gather"
    p8 = plan_round(t, counts, make_codec("int8", block_size=100), inner_steps=10)  # default: two-phase
    r8 = {r.module_id: r for r in p8.modules}
    # k=2, slice 500 → 2 chunks of 300 (block-aligned, padded): 2·(k−1)·(300 + 4·3)
    assert r8["L0.0"].bytes_per_rank == reduce_scatter_bytes(2, 300 + 4 * 3) + meta_intra
    assert r8["L0.0"].exchange == "reduce_scatter" and r8["L1.0"].exchange == "local"
    # auto: k=2 with padding is cheaper as an all-gather
    auto = {r.module_id: r for r in plan_round(t, counts, make_codec("int8", block_size=100), 10, lossy_exchange="auto").modules}
    assert auto["L0.0"] == rag["L0.0"]
    text = format_plan(p8)
    assert "embed" in text and "DDP equivalent" in text and "reduce_scatter" in text
    with pytest.raises(ValueError, match="lossy_exchange"):
        plan_round(t, counts, make_codec("int8"), lossy_exchange="ring")
    with pytest.raises(ValueError, match="diloco.codec"):
        make_codec("zip")
