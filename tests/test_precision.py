"""The inner loop's precision and speed options on a tiny path (dipaco/rounds/learner.py).

bf16 autocast trains and keeps fp32 masters; micro-batches give the update of one big
batch; activation checkpointing and torch.compile change no numbers. CUDA-only checks
(fused AdamW, fp16 with a loss scaler, compile with inductor) carry the gpu marker.
"""
from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch

from dipaco.config import TrainerConfig
from dipaco.rounds.learner import PathLearner
from modules import ModelConfig, ModuleGrid, PathModel

TINY = ModelConfig(vocab_size=64, d_model=32, n_heads=2, layers_per_level=2, max_seq_len=32)


class FixedStream:
    """The same few batches in a cycle; some targets are -100 (uneven across halves)."""

    def __init__(self, n: int = 2, batch: int = 4, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.batches = []
        for _ in range(n):
            x = torch.randint(0, TINY.vocab_size, (batch, seq), generator=g)
            y = torch.roll(x, -1, dims=1)
            y[0, : seq // 2] = -100  # the first micro-batch carries fewer target tokens
            self.batches.append((x, y))
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batches[self.step % len(self.batches)]
        self.step += 1
        return b

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, s: dict) -> None:
        self.step = s["step"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny kernels: one thread is fastest, and far steadier on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _learner(device: str = "cpu", stream: Optional[FixedStream] = None, **trainer) -> PathLearner:
    grid = ModuleGrid(TINY, [1, 1], seed=0, device=device)
    cfg = TrainerConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0, **trainer)
    return PathLearner(0, PathModel(grid, 0), stream or FixedStream(), cfg, total_steps=100)


def _params(learner: PathLearner) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in learner.model.parameters()]


def _assert_same_update(start: list[torch.Tensor], a: list[torch.Tensor], b: list[torch.Tensor],
                        rel: float = 1e-2) -> None:
    """Two learners from the same start took the same steps: their updates agree to ``rel``.

    For another device or kernel (fused AdamW, inductor) elementwise closeness is the wrong
    yardstick: AdamW's first steps are about ``lr·sign(g)``, so a gradient element near zero
    whose sign a different summation order flips moves by up to 2·lr. The whole update,
    compared in norm, is what must not change.
    """
    da = torch.cat([(x - s).flatten() for x, s in zip(a, start)])
    db = torch.cat([(y - s).flatten() for y, s in zip(b, start)])
    ratio = float((da - db).norm() / da.norm())
    assert ratio <= rel, f"updates differ by {ratio:.2e} of their norm (> {rel:.0e})"


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float) -> None:
    assert len(a) == len(b)
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert worst <= atol, f"largest parameter difference {worst:.2e} > {atol:.0e}"


def test_bf16_autocast_trains_and_keeps_fp32_masters() -> None:
    learner = _learner(precision="bf16")
    losses = [learner.train_steps(1).loss for _ in range(12)]
    assert losses[-1] < losses[0] - 0.5, losses  # two cycled batches: memorised (fp32: 4.16 → 3.42)
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    for state in learner.optimizer.state.values():
        assert all(v.dtype == torch.float32 for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))


def test_bf16_computes_in_bf16() -> None:
    """bf16 must actually change the compute: same start, different (close) weights."""
    a, b = _learner(), _learner(precision="bf16")
    a.train_steps(2)
    b.train_steps(2)
    diff = max(float((x - y).abs().max()) for x, y in zip(_params(a), _params(b)))
    assert 0 < diff < 0.05


def _grads(learner: PathLearner) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for p in learner.model.parameters()]


@pytest.mark.parametrize("micro_batches", [2, 4])
def test_micro_batches_give_the_update_of_one_big_batch(micro_batches: int) -> None:
    whole, split = _learner(), _learner(micro_batches=micro_batches)
    s1, s2 = whole.train_steps(1), split.train_steps(1)
    assert s1.tokens == s2.tokens
    assert s1.loss == pytest.approx(s2.loss, rel=1e-5)
    # the step's (clipped) gradient: the same sum in another order
    _assert_close(_grads(whole), _grads(split), atol=1e-6)
    whole.train_steps(2)
    split.train_steps(2)
    # Adam divides by √v: rounding differences in tiny gradients grow, still far below lr
    _assert_close(_params(whole), _params(split), atol=2e-4)


def test_a_naive_mean_of_micro_batch_means_would_differ() -> None:
    """The slices hold unequal target counts, so the test above can tell the two apart."""
    naive = _learner()
    x, y = naive.stream.next_batch()
    loss = sum(torch.nn.functional.cross_entropy(naive.model(xs).flatten(0, 1), ys.flatten(), ignore_index=-100)
               for xs, ys in zip(x.chunk(4), y.chunk(4))) / 4
    exact = torch.nn.functional.cross_entropy(naive.model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
    assert abs(float(loss.detach()) - float(exact.detach())) > 1e-3  # the test would catch a naive average


def test_activation_checkpointing_changes_no_numbers() -> None:
    plain, ckpt = _learner(), _learner(activation_checkpointing=True)
    levels = [m for m in ckpt.model.modules() if hasattr(m, "activation_checkpointing")]
    assert levels and all(m.activation_checkpointing for m in levels)
    plain.train_steps(1)
    ckpt.train_steps(1)
    _assert_close(_grads(plain), _grads(ckpt), atol=1e-7)


def test_compile_shares_the_models_parameters() -> None:
    """torch.compile (the cheap eager backend here) trains the same parameters, same numbers."""
    plain, compiled = _learner(), _learner(compile=True, compile_backend="eager")
    assert compiled.forward is not compiled.model
    plain.train_steps(1)
    compiled.train_steps(1)
    _assert_close(_grads(plain), _grads(compiled), atol=1e-7)


def test_cpu_defaults_fp32_no_compile_no_scaler() -> None:
    learner = _learner()
    assert learner.forward is learner.model and learner.scaler is None
    assert not learner.optimizer.defaults.get("fused")


# ------------------------------------------------------------------ CUDA only


@pytest.mark.gpu
def test_cuda_learner_places_everything_on_the_gpu_and_matches_cpu() -> None:
    cpu, gpu = _learner(), _learner("cuda", compile=False)
    assert gpu.optimizer.defaults.get("fused") and gpu.device.type == "cuda"
    start = _params(cpu)
    cpu.train_steps(2)
    gpu.train_steps(2)
    _assert_same_update(start, _params(cpu), _params(gpu))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_low_precision_trains_with_fp32_masters(precision: str) -> None:
    learner = _learner("cuda", precision=precision, compile=False)
    assert (learner.scaler is not None) == (precision == "fp16")
    first = learner.train_steps(1).loss
    later = learner.train_steps(20).loss
    assert later < first - 0.5
    assert all(p.dtype == torch.float32 for p in learner.model.parameters())
    state = copy.deepcopy(learner.state_dict())
    assert ("scaler" in state) == (precision == "fp16")


@pytest.mark.gpu
def test_cuda_compile_with_inductor_matches_eager() -> None:
    plain, compiled = _learner("cuda", compile=False), _learner("cuda")  # compile defaults on
    assert compiled.forward is not compiled.model
    start = _params(plain)
    plain.train_steps(2)
    compiled.train_steps(2)
    _assert_same_update(start, _params(plain), _params(compiled))
