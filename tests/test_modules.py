"""Tests of the ``modules`` package: grid naming and radix, seeded lazy init, parameter
sharing between a PathModel and its grid, logits against a hand-written reference,
KV-cache decoding, tied embeddings, the dense warm start and config validation."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modules import KVCache, ModelConfig, ModuleGrid, PathModel, init_grid_from_dense

V, D = 64, 32


def tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=V, d_model=D, n_heads=2, layers_per_level=1, max_seq_len=32)
    base.update(overrides)
    return ModelConfig(**base)


def tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ hand-written reference


def ref_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pair (i, i + hd/2) of ``x [B, H, T, hd]`` by pos·theta^(-2i/hd), loop form."""
    hd = x.shape[-1]
    half = hd // 2
    out = x.clone()
    for t in range(x.shape[2]):
        for i in range(half):
            a = t * theta ** (-2 * i / hd)
            c, s = math.cos(a), math.sin(a)
            x1, x2 = x[:, :, t, i], x[:, :, t, i + half]
            out[:, :, t, i] = x1 * c - x2 * s
            out[:, :, t, i + half] = x1 * s + x2 * c
    return out


def ref_block(x: torch.Tensor, block, cfg: ModelConfig) -> torch.Tensor:
    """A pre-norm block from raw weights: softmax attention with an explicit causal mask."""
    B, T, C = x.shape
    H, hd = cfg.n_heads, cfg.head_dim
    h = ref_rms(x, block.attn_norm.weight, cfg.norm_eps)
    q, k, v = (h @ block.attn.qkv.weight.T).split(C, dim=2)
    q, k, v = (z.reshape(B, T, H, hd).permute(0, 2, 1, 3) for z in (q, k, v))
    q, k = ref_rope(q, cfg.rope_theta), ref_rope(k, cfg.rope_theta)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    att = scores.softmax(-1) @ v  # [B, H, T, hd]
    x = x + att.permute(0, 2, 1, 3).reshape(B, T, C) @ block.attn.proj.weight.T
    h = ref_rms(x, block.mlp_norm.weight, cfg.norm_eps)
    m = F.silu(h @ block.mlp.gate.weight.T) * (h @ block.mlp.up.weight.T)
    return x + m @ block.mlp.down.weight.T


@torch.no_grad()
def ref_logits(grid: ModuleGrid, module_ids: list[str], idx: torch.Tensor) -> torch.Tensor:
    """embed → every block of the listed level modules → head, written out by hand."""
    cfg = grid.cfg
    embed = grid.module(module_ids[0]).weight
    x = embed[idx]
    for mid in module_ids[1:-1]:
        for block in grid.module(mid).blocks:
            x = ref_block(x, block, cfg)
    head = grid.module(module_ids[-1])
    x = ref_rms(x, head.norm.weight, cfg.norm_eps)
    return x @ (embed if cfg.tie_embeddings else head.proj.weight).T


# ------------------------------------------------------------------ naming and radix


def test_module_ids_fixed_global_order():
    g = ModuleGrid(tiny(), [2, 3])
    assert g.module_ids == ["embed", "L0.0", "L0.1", "L1.0", "L1.1", "L1.2", "head"]
    p = ModuleGrid(tiny(), [2, 3], private_embed=True, private_head=True)
    assert p.module_ids == (
        [f"embed.p{i}" for i in range(6)] + ["L0.0", "L0.1", "L1.0", "L1.1", "L1.2"] + [f"head.p{i}" for i in range(6)]
    )
    assert ModuleGrid(tiny(), [2, 3], private_head=True).module_ids[-1] == "head.p5"


def test_mixed_radix_round_trip():
    g = ModuleGrid(tiny(), [4, 4])
    assert g.num_paths == 16 and g.levels == [4, 4]
    assert g.path_id_of((2, 1)) == 9 and g.path_of(9) == (2, 1)
    g3 = ModuleGrid(tiny(), [2, 3, 4])
    paths = [g3.path_of(p) for p in range(g3.num_paths)]
    assert paths == sorted(paths)  # level 0 most significant: ids ascend lexicographically
    assert len(set(paths)) == 24 and paths[-1] == (1, 2, 3)
    assert all(g3.path_id_of(path) == p for p, path in enumerate(paths))
    for bad in (-1, 16, 2.0, True):
        with pytest.raises(ValueError, match="path_id"):
            g.path_of(bad)
    with pytest.raises(ValueError):
        g.path_id_of((4, 0))
    with pytest.raises(ValueError):
        g.path_id_of((1,))


def test_path_module_membership():
    g = ModuleGrid(tiny(), [4, 4])
    assert g.module_ids_of_path(9) == ["embed", "L0.2", "L1.1", "head"]
    assert g.paths_of_module("L1.2") == [2, 6, 10, 14]
    assert g.paths_of_module("L0.3") == [12, 13, 14, 15]
    assert g.paths_of_module("embed") == list(range(16)) == g.paths_of_module("head")
    for p in range(g.num_paths):  # the two views agree everywhere
        for mid in g.module_ids:
            assert (mid in g.module_ids_of_path(p)) == (p in g.paths_of_module(mid))
    priv = ModuleGrid(tiny(), [4, 4], private_embed=True)
    assert priv.module_ids_of_path(9) == ["embed.p9", "L0.2", "L1.1", "head"]
    assert priv.paths_of_module("embed.p5") == [5]
    with pytest.raises(KeyError, match="L2.0"):
        g.paths_of_module("L2.0")
    with pytest.raises(KeyError):
        g.module("embed.p0")  # not private in this grid


@pytest.mark.parametrize("bad", [[], [0], [2, -1], "44", [1.5], [True], 4])
def test_grid_validation(bad):
    with pytest.raises(ValueError, match="grid"):
        ModuleGrid(tiny(), bad)


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(d_model=30, n_heads=4), "n_heads"),
        (dict(d_model=6, n_heads=2), "head_dim"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(layers_per_level=0), "layers_per_level"),
        (dict(mlp_hidden=0), "mlp_hidden"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(max_seq_len=2.5), "max_seq_len"),
    ],
)
def test_config_validation_names_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides).validate()
    with pytest.raises(ValueError, match=field):  # the grid validates too
        ModuleGrid(tiny(**overrides), [1])


def test_config_defaults_and_hidden():
    cfg = ModelConfig()
    assert (cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.layers_per_level, cfg.max_seq_len) == (2048, 64, 2, 1, 256)
    assert cfg.validate() is cfg
    assert cfg.hidden_dim == 176  # ceil(64·8/3)=171 → 176
    assert tiny().hidden_dim == 96  # ceil(32·8/3)=86 → 96
    assert tiny(mlp_hidden=50).hidden_dim == 50
    assert ModuleGrid(tiny(), [1]).module("L0.0").blocks[0].mlp.up.weight.shape == (96, D)


# ------------------------------------------------------------------ lazy, seeded init


def test_lazy_build_only_the_path():
    g = ModuleGrid(tiny(), [4, 4])
    assert g.built_modules() == {} and not g.is_built("embed")
    g.param_count("L1.3")  # sizes do not build anything
    assert g.built_modules() == {}
    PathModel(g, 0)
    assert list(g.built_modules()) == ["embed", "L0.0", "L1.0", "head"]
    PathModel(g, g.path_id_of((2, 1)))
    assert list(g.built_modules()) == ["embed", "L0.0", "L0.2", "L1.0", "L1.1", "head"]  # module_ids order


def test_init_depends_only_on_seed_and_module_id():
    a = ModuleGrid(tiny(), [4, 4], seed=3)
    b = ModuleGrid(tiny(), [4, 4], seed=3)
    torch.manual_seed(0)
    for mid in a.module_ids:
        a.module(mid)
    torch.manual_seed(12345)  # a different global RNG and the reverse build order
    for mid in reversed(b.module_ids):
        b.module(mid)
    for mid in a.module_ids:
        assert states_equal(a.module_state_dict(mid), b.module_state_dict(mid)), mid
        assert a.fingerprint(mid) == b.fingerprint(mid)
    other = ModuleGrid(tiny(), [4, 4], seed=4)
    for mid in a.module_ids:
        assert not states_equal(a.module_state_dict(mid), other.module_state_dict(mid)), mid
        assert a.fingerprint(mid) != other.fingerprint(mid)
    # Sibling modules of a level are different draws, and building leaves the global RNG alone.
    assert not torch.equal(a.module("L0.0").blocks[0].attn.qkv.weight, a.module("L0.1").blocks[0].attn.qkv.weight)
    before = torch.get_rng_state()
    ModuleGrid(tiny(), [2, 2], seed=9).build_path(3)
    assert torch.equal(before, torch.get_rng_state())
    # Which other modules exist does not matter either (same config, same id, same seed).
    assert states_equal(ModuleGrid(tiny(), [1, 1], seed=3).module_state_dict("L1.0"), a.module_state_dict("L1.0"))


@pytest.mark.multiprocess
def test_modules_is_a_leaf_package():
    """modules/ imports torch only: never dipaco or router, nor the router's libraries."""
    code = (
        "import importlib, pkgutil, sys, modules\n"
        "for info in pkgutil.walk_packages(modules.__path__, 'modules.'):\n"
        "    importlib.import_module(info.name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "             ('dipaco', 'router', 'faiss', 'sklearn', 'datasets', 'hydra', 'omegaconf'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


@pytest.mark.multiprocess
def test_init_identical_in_another_process():
    g = ModuleGrid(tiny(), [2, 2], seed=7)
    code = (
        "import sys, json\n"
        "from modules import ModelConfig, ModuleGrid\n"
        f"g = ModuleGrid(ModelConfig(vocab_size={V}, d_model={D}, n_heads=2, max_seq_len=32), [2, 2], seed=7)\n"
        "fp = {m: g.fingerprint(m) for m in reversed(g.module_ids)}\n"
        "leak = sorted(m for m in sys.modules if m.split('.')[0] in ('dipaco', 'router'))\n"
        "print(json.dumps({'fp': fp, 'leak': leak}))\n"
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert out["leak"] == []  # modules/ must never import dipaco or router
    assert out["fp"] == {m: g.fingerprint(m) for m in g.module_ids}


# ------------------------------------------------------------------ PathModel


def test_path_model_shares_storage_with_grid():
    g = ModuleGrid(tiny(), [4, 4])
    model = PathModel(g, g.path_id_of((2, 1)))
    assert model.module_ids == ["embed", "L0.2", "L1.1", "head"] and model.path == (2, 1) and model.path_id == 9
    grid_params = [p for mid in model.module_ids for p in g.module(mid).parameters()]
    assert [p.data_ptr() for p in model.parameters()] == [p.data_ptr() for p in grid_params]
    # Modify through the model, see it in the grid; modify the grid, see it in the model.
    with torch.no_grad():
        model.levels[0].blocks[0].attn.qkv.weight[0, 0] = 5.0
        g.module("L1.1").blocks[0].mlp.down.weight[1, 1] = -7.0
    assert g.module("L0.2").blocks[0].attn.qkv.weight[0, 0].item() == 5.0
    assert model.levels[1].blocks[0].mlp.down.weight[1, 1].item() == -7.0
    # An optimiser step on one path moves the module every path containing it sees.
    neighbour = PathModel(g, g.path_id_of((2, 3)))
    before = neighbour.levels[0].blocks[0].mlp.up.weight.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(tokens(2, 8)).logsumexp(-1).mean().backward()
    opt.step()
    assert not torch.equal(before, neighbour.levels[0].blocks[0].mlp.up.weight)
    assert all(p.grad is not None for p in model.parameters())
    assert model.state_dict().keys() == {f"embed.{k}" for k in g.module_state_dict("embed")} | {
        f"levels.{i}.{k}" for i, mid in enumerate(["L0.2", "L1.1"]) for k in g.module_state_dict(mid)
    } | {f"head.{k}" for k in g.module_state_dict("head")}


@pytest.mark.parametrize("layers_per_level", [1, 2])
def test_logits_match_hand_built_model(layers_per_level):
    g = ModuleGrid(tiny(layers_per_level=layers_per_level), [4, 4], seed=1)
    model = PathModel(g, g.path_id_of((2, 1)))
    idx = tokens(2, 9)
    with torch.no_grad():
        logits = model(idx)
    assert logits.shape == (2, 9, V) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits(g, ["embed", "L0.2", "L1.1", "head"], idx), rtol=1e-4, atol=1e-5)
    # The reference is sensitive to which modules are used: another path gives other logits.
    assert not torch.allclose(logits, ref_logits(g, ["embed", "L0.2", "L1.2", "head"], idx), atol=1e-4)


def test_param_counts():
    cfg = tiny(layers_per_level=2)
    g = ModuleGrid(cfg, [4, 3])
    h = cfg.hidden_dim
    block = 2 * D + 4 * D * D + 3 * D * h  # two norms, qkv + proj, gate/up/down
    assert g.param_count("embed") == V * D
    assert g.param_count("head") == D + D * V
    assert g.param_count("L1.2") == 2 * block
    for p in (0, 5, 11):
        expected = sum(g.param_count(m) for m in g.module_ids_of_path(p))
        assert g.path_param_count(p) == expected == V * D + 2 * 2 * block + D + D * V
        assert PathModel(g, p).num_parameters() == expected
    assert g.total_param_count() == V * D + 7 * 2 * block + D + D * V
    assert all(g.param_count(m) == sum(x.numel() for x in g.module(m).parameters()) for m in g.module_ids)


def test_specialised_param_counts():
    """What routing can specialise: modules not every path shares (contract of dipaco-plan)."""
    cfg = tiny(layers_per_level=2)
    h = cfg.hidden_dim
    block = 2 * D + 4 * D * D + 3 * D * h
    assert ModuleGrid(cfg, [4, 3]).specialised_param_count(5) == 2 * 2 * block
    # a K = 1 level is shared by every path: nothing to specialise there
    assert ModuleGrid(cfg, [4, 1]).specialised_param_count(2) == 2 * block
    assert ModuleGrid(cfg, [1, 1]).specialised_param_count(0) == 0
    # a private head is trained by its path alone
    g = ModuleGrid(cfg, [2, 2], private_head=True)
    assert g.specialised_param_count(3) == 2 * 2 * block + D + D * V
    # tying moves the output projection into the shared embed: the head is a norm
    tied = ModuleGrid(tiny(layers_per_level=2, tie_embeddings=True), [2, 2])
    assert tied.specialised_param_count(0) == 2 * 2 * block
    assert tied.path_param_count(0) == V * D + 2 * 2 * block + D


# ------------------------------------------------------------------ KV cache


def test_kv_cache_decoding_matches_full_forward():
    g = ModuleGrid(tiny(layers_per_level=2), [2, 2], seed=2)
    model = PathModel(g, 3).eval()
    idx = tokens(2, 14)
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(batch_size=2)
        assert isinstance(cache, KVCache) and cache.length == 0
        pieces = [model(idx[:, :5], cache)]  # prompt, then one token at a time
        for t in range(5, 9):
            pieces.append(model(idx[:, t : t + 1], cache))
        pieces.append(model(idx[:, 9:12], cache))  # a chunk after a prefix: the offset mask
        pieces.append(model(idx[:, 12:], cache))
    assert cache.length == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="batch"):
        model(idx[:1, :1], model.new_kv_cache(batch_size=2))
    small = model.new_kv_cache(2, max_len=4)
    with pytest.raises(ValueError, match="max_len"):
        model(idx[:, :5], small)
    with pytest.raises(ValueError, match="max_seq_len"):
        model.new_kv_cache(1, max_len=33)
    cache.reset()
    with torch.no_grad():
        torch.testing.assert_close(model(idx[:, :3], cache), full[:, :3], rtol=1e-4, atol=1e-5)


def test_generate_greedy_matches_step_by_step_argmax():
    g = ModuleGrid(tiny(), [2, 2], seed=5)
    model = PathModel(g, 1).eval()
    prompt = tokens(2, 4)
    out = model.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 10) and torch.equal(out[:, :4], prompt)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    sampled = model.generate(prompt, 3, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 7) and int(sampled.max()) < V
    with pytest.raises(ValueError, match="max_seq_len"):
        model.generate(prompt, 40)


def test_forward_rejects_bad_input():
    model = PathModel(ModuleGrid(tiny(), [1]), 0)
    with pytest.raises(ValueError, match="token ids"):
        model(torch.tensor([[0, V]]))
    with pytest.raises(ValueError, match="shape"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens(1, 33))


# ------------------------------------------------------------------ tied embeddings


def test_tied_embeddings():
    cfg = tiny(tie_embeddings=True)
    g = ModuleGrid(cfg, [2, 2], seed=4)
    model = PathModel(g, 2)
    assert g.module("head").proj is None and g.param_count("head") == D
    params = list(model.parameters())
    assert sum(p is g.module("embed").weight for p in params) == 1
    assert model.num_parameters() == g.path_param_count(2) == V * D + 2 * g.param_count("L0.0") + D
    idx = tokens(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), ref_logits(g, model.module_ids, idx), rtol=1e-4, atol=1e-5)
    # The embed weight really is the output projection: its gradient has two sources.
    model(idx).sum().backward()
    assert g.module("embed").weight.grad is not None
    assert torch.count_nonzero(g.module("embed").weight.grad.abs().sum(-1)) == V  # every row, not only inputs
    with pytest.raises(ValueError, match="tie_embeddings"):
        ModuleGrid(cfg, [2], private_embed=True)
    both = ModuleGrid(cfg, [2], private_embed=True, private_head=True)
    assert PathModel(both, 1).module_ids == ["embed.p1", "L0.1", "head.p1"]


# ------------------------------------------------------------------ state dicts and warm start


def test_module_state_dict_round_trip():
    a, b = ModuleGrid(tiny(), [2, 2], seed=0), ModuleGrid(tiny(), [2, 2], seed=1)
    assert not states_equal(a.module_state_dict("L1.1"), b.module_state_dict("L1.1"))
    b.load_module_state_dict("L1.1", {k: v.clone() for k, v in a.module_state_dict("L1.1").items()})
    assert states_equal(a.module_state_dict("L1.1"), b.module_state_dict("L1.1"))
    assert b.module_state_dict("L1.1")["blocks.0.attn.qkv.weight"].data_ptr() == b.module("L1.1").blocks[0].attn.qkv.weight.data_ptr()
    with pytest.raises(ValueError, match="'L0.0'"):
        b.load_module_state_dict("L0.0", a.module_state_dict("embed"))


def test_init_from_dense_copies_into_every_copy():
    cfg = tiny()
    dense = ModuleGrid.dense(cfg, 2, seed=11)
    dmodel = PathModel(dense, 0)
    with torch.no_grad():  # move away from the seed init so a copy cannot pass by accident
        for p in dmodel.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    g = ModuleGrid(cfg, [2, 3], private_embed=True, private_head=True, seed=0)
    g.module("L0.1")  # built before the warm start: overwritten now
    g.init_from_dense(dense)
    for mid in g.module_ids:  # the rest are built after it: initialised from the snapshot
        assert states_equal(g.module_state_dict(mid), dense.module_state_dict(g.dense_source_id(mid))), mid
    idx = tokens(2, 7)
    with torch.no_grad():
        want = dmodel(idx)
        for p in range(g.num_paths):
            torch.testing.assert_close(PathModel(g, p)(idx), want)
    # A snapshot: training the dense model afterwards does not leak into later builds.
    g2 = ModuleGrid(cfg, [2, 2], seed=0).init_from_dense(dense)
    with torch.no_grad():
        dense.module("L1.0").blocks[0].attn.proj.weight.zero_()
    assert g2.module("L1.1").blocks[0].attn.proj.weight.abs().sum() > 0
    # Copies are independent tensors, not aliases of one another.
    assert g2.module("L1.0").blocks[0].mlp.up.weight.data_ptr() != g2.module("L1.1").blocks[0].mlp.up.weight.data_ptr()


def test_init_from_dense_errors():
    cfg = tiny()
    g = ModuleGrid(cfg, [2, 2])
    with pytest.raises(ValueError, match=r"\[1, 1\]"):
        g.init_from_dense(ModuleGrid(cfg, [2, 1]))
    with pytest.raises(ValueError, match=r"\[1, 1\]"):
        g.init_from_dense(ModuleGrid.dense(cfg, 3))
    with pytest.raises(ValueError, match="ModelConfig"):
        g.init_from_dense(ModuleGrid.dense(tiny(d_model=16), 2))
    dense = ModuleGrid.dense(cfg, 2)
    state = {m: dense.module_state_dict(m) for m in dense.module_ids}
    with pytest.raises(ValueError, match="L1.0"):
        init_grid_from_dense(g, {k: v for k, v in state.items() if k != "L1.0"})
    bad = dict(state, embed={"weight": torch.zeros(V + 1, D)})
    with pytest.raises(ValueError, match="shape"):
        init_grid_from_dense(g, bad)
    tied = ModuleGrid(tiny(tie_embeddings=True), [2, 2])
    with pytest.raises(ValueError, match="tie_embeddings"):
        init_grid_from_dense(tied, state)
    # From plain state dicts with private-module names (e.g. loaded from safetensors).
    renamed = {("embed.p0" if k == "embed" else k): {n: t.clone() for n, t in v.items()} for k, v in state.items()}
    init_grid_from_dense(g, renamed)
    assert states_equal(g.module_state_dict("L0.1"), state["L0.0"])
