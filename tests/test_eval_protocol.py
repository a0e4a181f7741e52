"""The long evaluation protocol (trainer.eval_long): whole documents in windows, the
routing prefix excluded from the loss, re-routing from past tokens only; its config checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dipaco.config import ConfigError, compose_config
from dipaco.rounds.evaluate import evaluate_routed, evaluate_single, plan_documents, split_windows
from dipaco.config.validate import validate_config

PREFIX = 8


class _Bigram(torch.nn.Module):
    """Logits depend on the current token only; ``huge`` multiplies them at positions <
    ``PREFIX - 1`` of every window (the targets inside the prefix): a model whose loss on
    the prefix is enormous."""

    def __init__(self, vocab: int = 17, huge: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))
        self.huge = huge
        self.lengths: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lengths.append(x.shape[1])
        out = self.table[x]
        if self.huge:
            out = out.clone()
            out[:, : PREFIX - 1] *= 1e4
        return out


def _docs(n: int = 9, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 17, size=int(k)) for k in rng.integers(PREFIX, 140, size=n)]


def _route(prefixes: list[np.ndarray]) -> np.ndarray:
    return np.array([int(p[0]) % 2 for p in prefixes], dtype=np.int64)


def test_windows_cover_every_target_after_the_prefix_once() -> None:
    docs = _docs()
    planned, skipped = plan_documents(docs, seq_len=16, prefix_tokens=PREFIX, route_batch=_route,
                                      whole_documents=True)
    assert skipped == 0 and [len(d.tokens) for d in planned] == [len(d) for d in docs]
    pieces = split_windows(planned, 16)
    assert all(len(p.tokens) <= 17 for p in pieces)
    # every target position ≥ PREFIX of every document is scored in exactly one window
    scored = sum(int((p.token_paths[1:] >= 0).sum()) for p in pieces)
    assert scored == sum(len(d) - PREFIX for d in docs)
    report = evaluate_single(docs, _Bigram(), seq_len=16, prefix_tokens=PREFIX, whole_documents=True)
    assert report["num_tokens"] == scored and report["num_documents"] == len(docs)
    assert report["num_windows"] == len(pieces) > len(docs)


def test_long_protocol_reports_the_first_window_apart_from_the_later_ones() -> None:
    docs = _docs()
    long = evaluate_single(docs, _Bigram(), seq_len=16, prefix_tokens=PREFIX, whole_documents=True)
    first, later = long["by_window"]["first_window"], long["by_window"]["later_windows"]
    # the first window is exactly what the short protocol scores at the same length
    short = evaluate_single(docs, _Bigram(), seq_len=16, prefix_tokens=PREFIX)
    assert "by_window" not in short
    assert first["num_tokens"] == short["num_tokens"]
    assert first["loss"] == pytest.approx(short["loss"], rel=1e-9)
    # and the two parts add up to the whole
    assert first["num_tokens"] + later["num_tokens"] == long["num_tokens"]
    total = first["loss"] * first["num_tokens"] + later["loss"] * later["num_tokens"]
    assert total == pytest.approx(long["loss"] * long["num_tokens"], rel=1e-9)


def test_prefix_loss_does_not_change_the_score() -> None:
    docs = _docs()
    # one window per document: a model terrible on the prefix targets scores the same
    plain = evaluate_single(docs, _Bigram(), seq_len=200, prefix_tokens=PREFIX, whole_documents=True)
    huge = evaluate_single(docs, _Bigram(huge=True), seq_len=200, prefix_tokens=PREFIX, whole_documents=True)
    assert plain["num_tokens"] == huge["num_tokens"] > 0
    assert huge["loss"] == pytest.approx(plain["loss"], rel=1e-9)
    # the control: the same huge logits on scored targets do change it
    later = evaluate_single(docs, _Bigram(huge=True), seq_len=4, prefix_tokens=PREFIX, whole_documents=True)
    assert later["loss"] > 10 * plain["loss"]


def test_long_protocol_equals_the_short_one_on_short_documents() -> None:
    docs = [d[:30] for d in _docs()]
    short = evaluate_single(docs, _Bigram(), seq_len=40, prefix_tokens=PREFIX)
    long = evaluate_single(docs, _Bigram(), seq_len=40, prefix_tokens=PREFIX, whole_documents=True)
    assert long["loss"] == pytest.approx(short["loss"], rel=1e-12) and long["num_tokens"] == short["num_tokens"]


def test_the_model_never_sees_more_than_a_window() -> None:
    model = _Bigram()
    evaluate_single(_docs(), model, seq_len=16, prefix_tokens=PREFIX, whole_documents=True, batch_size=4)
    assert max(model.lengths) <= 16


def test_rerouting_decides_each_window_from_past_tokens_only() -> None:
    """Changing a document's tokens at or after position j never changes the path of a
    target before j (window boundaries every W, routed by the tokens before them)."""
    W, seen = 12, []

    def route(prefixes: list[np.ndarray]) -> np.ndarray:
        seen.extend(len(p) for p in prefixes)
        return np.array([int(p.sum()) % 3 for p in prefixes], dtype=np.int64)

    def windows(doc: np.ndarray, w: int) -> list[int]:  # the Router.reroute_windows rule
        n = -(-len(doc) // w)
        ctx = [doc[:PREFIX]] + [doc[max(0, j * w - PREFIX) : j * w] for j in range(1, n)]
        return route(ctx).tolist()

    doc = np.random.default_rng(1).integers(0, 17, size=100)
    base, _ = plan_documents([doc], seq_len=32, prefix_tokens=PREFIX, route_batch=route,
                             reroute_windows=windows, reroute_every=W, whole_documents=True)
    for j in range(PREFIX + 1, 100):
        changed = doc.copy()
        changed[j:] = (changed[j:] + 5) % 17
        other, _ = plan_documents([changed], seq_len=32, prefix_tokens=PREFIX, route_batch=route,
                                  reroute_windows=windows, reroute_every=W, whole_documents=True)
        assert np.array_equal(other[0].token_paths[: j + 1], base[0].token_paths[: j + 1]), j
    assert (base[0].token_paths[:PREFIX] == -1).all() and (base[0].token_paths[PREFIX:] >= 0).all()


def test_routed_long_uses_one_path_per_document() -> None:
    docs = _docs()
    models = {0: _Bigram(), 1: _Bigram()}
    report = evaluate_routed(docs, models.__getitem__, seq_len=16, prefix_tokens=PREFIX, route_batch=_route,
                             whole_documents=True)
    assert sum(v["num_tokens"] for v in report["per_path"].values()) == report["num_tokens"]


@pytest.mark.parametrize("overrides, key", [
    (["trainer.eval_seq_len=512"], "trainer.eval_seq_len"),  # tiny: max_seq_len 128
    (["trainer.eval_seq_len=16"], "trainer.eval_seq_len"),  # not past the 32-token prefix
    (["trainer.eval_every=0"], "trainer.eval_every"),
    (["diloco.alpha=docs"], "diloco.alpha"),
    (["trainer.path_early_stopping=true", "diloco.mode=decoupled"], "trainer.path_early_stopping"),
    (["trainer.path_early_stopping=true", "router.reshard_at_round=1"], "trainer.path_early_stopping"),
])
def test_config_errors_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    cfg = compose_config(["model=tiny", "trainer=tiny", "trainer.rounds=3", *overrides])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.key == key and "Fix:" in str(e.value)


def test_eval_seq_len_within_the_model_range_is_accepted() -> None:
    validate_config(compose_config(["model=tiny", "trainer=tiny", "trainer.eval_long=true",
                                    "model.max_seq_len=512", "trainer.eval_seq_len=512"]))


def test_long_windows_default_to_the_trained_length_not_the_rotary_range() -> None:
    from dipaco.config import eval_window

    cfg = compose_config(["trainer.seq_len=96", "model.max_seq_len=256"])
    assert eval_window(cfg) == 96  # positions 96..255 were never trained
    assert eval_window(compose_config(["trainer.seq_len=96", "trainer.eval_seq_len=200"])) == 200
