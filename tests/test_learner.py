"""The path learner's inner loop: a non-finite step is skipped exactly, whichever side
gates it (the host reading a flag each step, or the fused AdamW on the device), and a
turn's loss, tokens and skip count are the applied steps'."""
from __future__ import annotations

import torch

from dipaco.config import TrainerConfig
from dipaco.rounds.learner import PathLearner, make_inner_optimizer

# constant lr (no warm-up, cosine floor = lr): a skipped step must not shift the schedule
CFG = TrainerConfig(warmup_steps=0, min_lr_ratio=1.0, grad_clip=1.0, lr=1e-2)


class Stream:
    """Seeded batches; ``skip`` drops batch indices (the oracle that never saw them)."""

    def __init__(self, skip: tuple[int, ...] = ()) -> None:
        self.gen, self.i, self.skip = torch.Generator().manual_seed(0), 0, skip

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            x = torch.randint(0, 16, (2, 8), generator=self.gen)
            self.i += 1
            if self.i - 1 not in self.skip:
                y = torch.roll(x, -1, dims=1)
                y[:, -1] = -100  # the last position carries no loss
                return x, y

    def state_dict(self) -> dict:
        return {}


def _learner(stream: Stream, fused: bool, poison_call: int = -1) -> PathLearner:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    calls = {"n": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == poison_call else grad

    model[1].weight.register_hook(poison)
    learner = PathLearner(0, model, stream, CFG, total_steps=10)
    learner.optimizer = make_inner_optimizer(model, CFG, fused=fused)
    return learner


def _state(learner: PathLearner) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in learner.params]
    for st in learner.optimizer.state.values():
        out += [v.detach().clone() for _, v in sorted(st.items())]
    return out


def test_the_fused_optimiser_skips_on_the_device_and_the_cpu_one_on_the_host() -> None:
    assert _learner(Stream(), fused=True)._gate_on_device()
    assert not _learner(Stream(), fused=False)._gate_on_device()


def test_a_non_finite_step_is_skipped_exactly_on_either_side() -> None:
    """Step 2 of 5 gets a NaN gradient: parameters, AdamW moments and step counts end
    where a learner that never saw batch 2 ends (with the same lr), and the turn's stats
    count only the applied steps."""
    for fused in (True, False):
        hit = _learner(Stream(), fused=fused, poison_call=2)
        stats = hit.train_steps(5)
        oracle = _learner(Stream(skip=(1,)), fused=fused)
        want = oracle.train_steps(4)
        assert (stats.steps, stats.skipped, hit.step) == (4, 1, 5), fused
        assert stats.tokens == want.tokens and stats.loss == want.loss, fused
        for a, b in zip(_state(hit), _state(oracle), strict=True):
            assert torch.equal(a, b), fused


def test_turn_totals_are_the_applied_steps_sums() -> None:
    learner = _learner(Stream(), fused=False)
    seen: list[int] = []
    stats = learner.train_steps(3, on_step=lambda: seen.append(learner.step))
    assert seen == [1, 2, 3] and stats.steps == 3 and stats.skipped == 0
    assert stats.tokens == 3 * 2 * 7  # batch 2 x 8 positions, the last one without a target
    assert stats.loss > 0 and stats.loss == stats.loss_sum / 3
