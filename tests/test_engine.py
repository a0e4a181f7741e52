"""dipaco.inference.RoutedEngine: batched routed generation gives every prompt exactly the
tokens one-prompt ``generate_routed`` gives it (greedy and seeded sampling, with and without
re-routing, prompts shorter than the routing prefix and longer than max_seq_len), rows
leave at eos / max_new_tokens / cancel, the path bound holds, bad requests are one line.

Uses the shared tiny finished run (tests/_hostile.py's ``finished``), never trains its own.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from dipaco.inference import InferenceRun, Request, RoutedEngine
from modules import ModelConfig, ModuleGrid, PathModel
from dipaco.inference.engine_rows import PathBatch, Row
from dipaco.inference.generate import Generation
from modules.layers import DECODE_SPAN_BLOCK, decode_attention, decode_span
from modules.row_decode import RowCache, decode_rows


@pytest.fixture(scope="module")
def run(finished) -> InferenceRun:
    r = InferenceRun.open(finished[0])
    # re-route on the 16 tokens before each window (the smoke prefix), so windows change path
    r.router.reroute_context = 16
    return r


@pytest.fixture(scope="module")
def prompts(run) -> list[list[int]]:
    """Prompts of varied lengths: 1 token, shorter than the prefix, around and past max_seq_len."""
    from dipaco.data import load_corpus

    texts = list(load_corpus(run.cfg.data, progress=False).split("validation")["text"])
    rng = random.Random(0)
    L = run.cfg.model.max_seq_len
    # one in five at or past max_seq_len: those re-encode their window at every token (slow, both ways)
    lengths = [1, 2, 5, run.prefix_tokens - 1, run.prefix_tokens, 30, 50, 70, L, L + 9]
    out = []
    for i in range(200):
        ids = run.encode(texts[i % len(texts)] * 3)  # long enough for every length
        out.append(ids[: rng.choice(lengths)])
    return out


def _requests(prompts: list[list[int]], reroute: int | None, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i, p in enumerate(prompts):
        sampled = i % 3 == 0  # sampled rows share batches with greedy ones
        reqs.append(Request(p, max_new_tokens=rng.choice([1, 3, 6]), temperature=0.9 if sampled else 0.0,
                            top_k=rng.choice([None, 20]) if sampled else None,
                            top_p=rng.choice([None, 0.8]) if sampled else None, seed=i, reroute_every=reroute))
    return reqs


def _reference(run: InferenceRun, reqs: list[Request]) -> list:
    loader = run.loader(cache_size=run.num_paths)
    return [run.generate(r.prompt_ids, max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                         top_p=r.top_p, seed=r.seed, reroute_every=r.reroute_every, loader=loader) for r in reqs]


def _same(a, b) -> bool:
    return (a.tokens, a.window_paths, a.switches, a.stopped_at_eos) == (b.tokens, b.window_paths, b.switches,
                                                                         b.stopped_at_eos)


@pytest.mark.slow  # a few hundred prompts decoded twice: 30-70 s of CPU
@pytest.mark.parametrize("reroute", [None, 3])
def test_engine_gives_every_prompt_its_one_prompt_tokens(run, prompts, reroute) -> None:
    reqs = _requests(prompts if reroute is None else prompts[:60], reroute)
    done = []
    gens = RoutedEngine(run, max_batch_size=16).generate(reqs, on_result=lambda i, g: done.append(i))
    assert sorted(done) == list(range(len(reqs)))
    ref = _reference(run, reqs)
    bad = [i for i, (g, r) in enumerate(zip(gens, ref)) if not _same(g, r)]
    assert not bad, (f"{len(bad)} of {len(reqs)} differ; first: prompt of {len(reqs[bad[0]].prompt_ids)} tokens, "
                     f"engine {gens[bad[0]]} vs one prompt {ref[bad[0]]}")
    if reroute is not None:
        assert any(len(g.switches) > 1 for g in gens), "no row changed path: the re-routing test tests nothing"


def test_decode_rows_is_bit_identical_to_batch_one() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_heads=2, layers_per_level=1, max_seq_len=64)
    model = PathModel(ModuleGrid(cfg, [2, 2], seed=0), 1).eval()
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (1, 5, 17, 40, 63)]
    nxt = torch.randint(0, 97, (len(seqs),))
    cache = RowCache(model, 8)
    ref = []
    with torch.no_grad():
        for i, s in enumerate(seqs):
            cache.scratch.reset()
            model(torch.tensor([s]), cache.scratch)
            cache.fill(i, cache.scratch)
            alone = model.new_kv_cache(1)
            model(torch.tensor([s]), alone)
            ref.append(model(nxt[i].view(1, 1), alone)[0, -1])
        out = decode_rows(model, nxt, cache)
    assert all(torch.equal(out[i], ref[i]) for i in range(len(seqs)))
    assert cache.lengths[:len(seqs)] == [len(s) + 1 for s in seqs]


def test_attention_over_the_live_span_has_the_bits_of_the_whole_buffer() -> None:
    """A decode step reads only the blocks that cover the longest row; that must not move a
    bit, for a batch or a row alone, at any length (on this machine's kernels)."""
    torch.manual_seed(0)
    bad = []
    for max_len in (128, 256, 512):
        for B in (1, 3, 16):
            q, keys, values = torch.randn(B, 2, 1, 32), torch.randn(B, 2, max_len, 32), torch.randn(B, 2, max_len, 32)
            lengths = torch.randint(1, max_len + 1, (B,))
            whole = decode_attention(q, keys, values, lengths)
            live = decode_attention(q, keys, values, lengths, int(lengths.max()))
            bad += [("batch", max_len, B)] * (not torch.equal(live, whole))
            for i in range(B):
                alone = decode_attention(q[i:i + 1], keys[i:i + 1], values[i:i + 1], lengths[i:i + 1], int(lengths[i]))
                bad += [("alone", max_len, int(lengths[i]))] * (not torch.equal(alone[0], whole[i]))
    assert not bad, f"the live span changed bits: {bad[:5]}"
    assert decode_span(1, 256) == DECODE_SPAN_BLOCK and decode_span(255, 256) == 256


def test_fast_padded_prefill_is_each_rows_own_prefill_up_to_rounding() -> None:
    """exact=False encodes fresh rows of different lengths in one right-padded forward: each
    row's logits and cached keys are what encoding it alone gives, up to rounding."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_heads=2, layers_per_level=1, max_seq_len=64)
    model = PathModel(ModuleGrid(cfg, [2, 2], seed=0), 1).eval()
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (1, 5, 17, 40, 63)]
    batch = PathBatch(model, 1, 8, True, exact=False)
    for i, s in enumerate(seqs):
        batch.join(Row(i, Request(s), Generation(prompt=s), list(s)))
    with torch.no_grad():
        rows = list(batch.fresh)
        padded = batch._encode_padded(rows)
        for i, row in enumerate(rows):
            alone = model.new_kv_cache(1)
            ref = model(torch.tensor([row.seq]), alone)[0, -1]
            torch.testing.assert_close(padded[i], ref, rtol=1e-5, atol=1e-5)
            n = len(row.seq)
            assert batch.cache.lengths[row.slot] == n
            torch.testing.assert_close(batch.cache.k[:, row.slot, :, :n], alone.k[:, 0, :, :n], rtol=1e-5, atol=1e-5)


def test_fast_decode_is_the_exact_decode_up_to_rounding() -> None:
    """exact=False (one matrix product per layer for the batch) computes the same logits as the
    row-exact decode up to float rounding; only the bits may differ."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, d_model=32, n_heads=2, layers_per_level=1, max_seq_len=64)
    model = PathModel(ModuleGrid(cfg, [2, 2], seed=0), 1).eval()
    seqs = [torch.randint(0, 97, (n,)).tolist() for n in (1, 5, 17, 40, 63)]
    nxt = torch.randint(0, 97, (len(seqs),))
    out = {}
    for exact in (True, False):
        cache = RowCache(model, 8)
        with torch.no_grad():
            for i, s in enumerate(seqs):
                cache.scratch.reset()
                model(torch.tensor([s]), cache.scratch)
                cache.fill(i, cache.scratch)
            out[exact] = decode_rows(model, nxt, cache, exact=exact)
    torch.testing.assert_close(out[False], out[True], rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # both engines over the prompt set: ~17 s of CPU
def test_the_fast_engine_answers_like_the_exact_one(run, prompts) -> None:
    reqs = [Request(p, max_new_tokens=4) for p in prompts[:40]]
    exact = RoutedEngine(run, max_batch_size=16).generate(reqs)
    fast = RoutedEngine(run, max_batch_size=16, exact=False).generate(reqs)
    same = sum(a.tokens == b.tokens for a, b in zip(exact, fast))
    assert same >= 36, f"only {same} of 40 prompts got the exact engine's greedy tokens in fast mode"


def test_a_sample_does_not_depend_on_its_batch(run, prompts) -> None:
    me = Request(prompts[40], max_new_tokens=6, temperature=1.0, top_p=0.9, seed=123)
    others = [Request(p, max_new_tokens=5, temperature=1.0, seed=k) for k, p in enumerate(prompts[:7])]
    alone = RoutedEngine(run, max_batch_size=1).generate([me])[0].tokens
    crowded = RoutedEngine(run, max_batch_size=8).generate([*others, me, *others[:3]])[7].tokens
    assert alone == crowded
    other_seed = RoutedEngine(run).generate([Request(me.prompt_ids, max_new_tokens=6, temperature=1.0,
                                                     top_p=0.9, seed=124)])[0].tokens
    assert other_seed != alone or len(set(alone)) == 1  # the seed matters


def test_rows_leave_at_eos_and_max_new_tokens(run, prompts) -> None:
    eng = RoutedEngine(run, max_batch_size=4)
    first = eng.generate([Request(prompts[50], max_new_tokens=3)])[0].tokens
    eng.eos = first[1]  # make the second greedy token the end of text
    a = eng.submit(Request(prompts[50], max_new_tokens=10))
    b = eng.submit(Request(prompts[50], max_new_tokens=10, stop_at_eos=False))
    c = eng.submit(Request(prompts[50], max_new_tokens=1))
    z = eng.submit(Request(prompts[50], max_new_tokens=0))
    finished = {}
    while eng.has_work():
        for ev in eng.step():
            if ev.finished:
                finished[ev.request_id] = ev
    upto = first[: first.index(first[1]) + 1]
    assert (finished[a].finish_reason, finished[a].generation.tokens) == ("eos", upto)
    assert finished[a].generation.stopped_at_eos
    assert finished[b].finish_reason == "length" and len(finished[b].generation.tokens) == 10
    assert finished[c].finish_reason == ("eos" if first[0] == first[1] else "length")
    assert finished[c].generation.tokens == first[:1]
    assert finished[z].token is None and finished[z].generation.tokens == []


def test_cancel_frees_a_row(run, prompts) -> None:
    eng = RoutedEngine(run, max_batch_size=2)
    p = prompts[60]
    ids = [eng.submit(Request(p, max_new_tokens=50, stop_at_eos=False)) for _ in range(3)]
    eng.step()
    assert len(eng._batch.rows) == 2  # the third waits for a free row
    eng.cancel(ids[0])
    events = eng.step()
    gone = [e for e in events if e.request_id == ids[0]]
    assert len(gone) == 1 and gone[0].finished and gone[0].finish_reason == "cancelled" and gone[0].token is None
    assert {r.rid for r in eng._batch.rows} == {ids[1], ids[2]}  # the freed row went to the waiting one
    eng.cancel(ids[1])
    eng.cancel(ids[2])
    eng.step()
    assert not eng.has_work()


def test_loaded_paths_stay_within_the_bound(run, prompts) -> None:
    eng = RoutedEngine(run, max_batch_size=8, max_loaded_paths=2)
    seen = []
    get = eng.loader.get

    def spy(path):
        model = get(path)
        seen.append(len(eng.loader.loaded_paths))
        return model

    eng.loader.get = spy
    gens = eng.generate([Request(p, max_new_tokens=3, reroute_every=2) for p in prompts[:30]])
    assert len({p for g in gens for _, p in g.switches}) > 2, "the prompts use more paths than the bound"
    assert seen and max(seen) <= 2


def test_submit_from_another_thread_while_stepping(run, prompts) -> None:
    eng = RoutedEngine(run, max_batch_size=4, patience=2)
    results: dict[int, list[int]] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set() or eng.has_work():
            for ev in eng.step():
                if ev.finished:
                    results[ev.request_id] = ev.generation.tokens

    t = threading.Thread(target=loop)
    t.start()
    ids = [eng.submit(Request(p, max_new_tokens=3)) for p in prompts[:12]]
    stop.set()
    t.join(timeout=120)
    assert not t.is_alive() and sorted(results) == ids
    alone = RoutedEngine(run).generate([Request(prompts[5], max_new_tokens=3)])[0].tokens
    assert results[ids[5]] == alone


@pytest.mark.parametrize("bad, words", [
    (Request([]), "empty"), (Request([10**9]), "outside the vocabulary"), (Request([1], top_p=0.0), "top_p"),
    (Request([1], temperature=-1.0), "temperature"), (Request([1], top_k=0), "top_k"),
    (Request([1], reroute_every=0), "reroute_every"), (Request([1], max_new_tokens=-1), "max_new_tokens"),
])
def test_a_bad_request_is_one_line(run, bad, words) -> None:
    with pytest.raises(ValueError, match=words) as e:
        RoutedEngine(run).submit(bad)
    assert "\n" not in str(e.value)


@pytest.mark.gpu
def test_engine_on_cuda_matches_one_prompt(finished) -> None:
    run = InferenceRun.open(finished[0], device="cuda")
    reqs = [Request(run.encode("def f(x):\n    return x" * k)[: 5 + 7 * k], max_new_tokens=12) for k in range(1, 25)]
    eng = RoutedEngine(run, max_batch_size=8)
    gens = eng.generate(reqs)
    assert eng.loader.get(gens[0].switches[0][1]).embed.weight.device.type == "cuda"
    ref = _reference(run, reqs)
    # cuBLAS may pick other kernels for a batch than for one row: near-ties may differ, rarely
    same = sum(g.tokens == r.tokens for g, r in zip(gens, ref))
    assert same >= len(reqs) - 2, f"only {same} of {len(reqs)} match one-prompt generation on CUDA"


def test_a_rows_sampler_is_a_cpu_generator_whatever_the_device() -> None:
    """One-prompt generation samples on the CPU; a CUDA generator seeded alike draws another
    stream, so the engine samples on the CPU too (found on an H200: every sampled row
    differed from its one-prompt tokens while greedy rows agreed)."""
    row = Row(0, Request([1, 2], temperature=0.9, seed=11), Generation(prompt=[1, 2]), [1, 2])
    gen = PathBatch._generator(row)
    assert gen.device.type == "cpu" and PathBatch._generator(row) is gen
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=torch.Generator().manual_seed(11)))
