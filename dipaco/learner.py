"""The inner loop of one path: AdamW with warm-up + cosine, clipping, its data stream.

A :class:`PathLearner` keeps its optimiser state and data position between its turns
(docs/design.md contract 3), so a worker group that trains several paths in turn resumes each
exactly where it stopped. In the local backend several learners hold the *same* module
tensors (paths share modules); each has its own AdamW state for them, as each path has
in a real deployment, and :class:`dipaco.sync.diloco.DiLoCoSync` restores the round's
global weights before every turn.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dipaco.config import TrainerConfig
from dipaco.schedule import lr_at


@dataclass
class InnerStats:
    """What one turn of inner steps did."""

    steps: int = 0
    tokens: int = 0  # target tokens that carried loss: the path's α this round
    loss_sum: float = 0.0
    seconds: float = 0.0
    skipped: int = 0  # steps whose gradient was NaN/inf: not applied (docs/reliability.md)

    @property
    def loss(self) -> float:
        return self.loss_sum / max(1, self.steps)


def make_inner_optimizer(model: nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norm gains), as is usual for transformers."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy; targets of -100 carry no loss."""
    # [B, T, V] → [B·T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction=reduction)


class PathLearner:
    """Trains one path: a model, its inner optimiser, its data stream and step count.

    Args:
        path_id: the path this learner trains.
        model: the path's model (a :class:`modules.PathModel`, or the dense model).
        stream: yields ``(x, y)`` batches; needs ``next_batch``, ``state_dict``, ``load_state_dict``.
        cfg: inner-loop settings.
        total_steps: inner steps over the whole run (sets the cosine schedule).
        grad_sync: called after backward, before clipping; averages gradients over the
            worker group when it has more than one rank (data parallel inside a path).
    """

    def __init__(self, path_id: int, model: nn.Module, stream: Any, cfg: TrainerConfig,
                 total_steps: int, grad_sync: Optional[Callable[[list[torch.Tensor]], None]] = None,
                 step_offset: int = 0) -> None:
        self.path_id = path_id
        self.model = model
        self.stream = stream
        self.cfg = cfg
        self.total_steps = total_steps
        self.grad_sync = grad_sync
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_inner_optimizer(model, cfg)
        self.step = 0
        # Steps already taken before this learner (the dense warm-up): the schedule of a
        # warm-started path continues where the warm-up left it.
        self.step_offset = step_offset

    def train_steps(self, n: int, on_step: Optional[Callable[[float], None]] = None,
                    should_stop: Optional[Callable[[], bool]] = None) -> InnerStats:
        """Run ``n`` inner steps; return tokens (α), mean loss and time.

        ``on_step(loss)`` runs after each applied step; ``should_stop()`` after each step
        ends the phase early when it returns True (decoupled mode's dynamic steps).
        """
        stats = InnerStats()
        self.model.train()
        t0 = time.perf_counter()
        for _ in range(n):
            lr = lr_at(self.step + self.step_offset, self.total_steps, self.cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            x, y = self.stream.next_batch()
            loss = lm_loss(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.grad_sync is not None:
                self.grad_sync(self.params)
            # max_norm=inf scales by exactly 1.0: the norm is still computed, for the check below
            clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
            self.step += 1
            value = float(loss.detach())
            if not bool(torch.isfinite(norm)):
                # One NaN/inf gradient would poison AdamW's moments and so every later
                # step of this path. Skip it instead; after grad_sync every rank of the
                # worker group sees the same norm, so they all skip together.
                self.optimizer.zero_grad(set_to_none=True)
                stats.skipped += 1
                continue
            self.optimizer.step()
            stats.steps += 1
            stats.tokens += int((y != -100).sum())
            stats.loss_sum += value
            if on_step is not None:
                on_step(value)
            if should_stop is not None and should_stop():
                break
        stats.seconds = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Inner optimiser state, step count and data position (checkpointed per path)."""
        return {"optimizer": self.optimizer.state_dict(), "step": self.step,
                "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.stream.load_state_dict(state["stream"])
