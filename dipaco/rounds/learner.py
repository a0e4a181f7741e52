"""The inner loop of one path: AdamW with warm-up + cosine, clipping, its data stream.

A :class:`PathLearner` keeps its optimiser state and data position between its turns
(docs/design.md contract 3), so a worker group that trains several paths in turn resumes each
exactly where it stopped. In the local backend several learners hold the *same* module
tensors (paths share modules); each has its own AdamW state for them, as each path has
in a real deployment, and :meth:`dipaco.sync.round_driver.RoundDriver.activate` puts the path's
copy of the global weights live before every turn.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from dipaco.config import TrainerConfig
from dipaco.runtime.device import autocast, compile_enabled, grad_scaler, maybe_compile, to_device
from dipaco.config.schedule import lr_at
from dipaco.rounds.turn_log import InnerStats, TurnLog
from dipaco.sync.fsdp import full_optimizer_state, full_value, is_sharded, shard_optimizer_state
from modules import set_activation_checkpointing


def make_inner_optimizer(model: nn.Module, cfg: TrainerConfig, fused: Optional[bool] = None) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norm gains), as is usual for transformers.

    Fused (one kernel for every parameter, and a non-finite step skipped on the device)
    when the parameters are on CUDA, or when ``fused`` says so.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused or None)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross entropy; targets of -100 carry no loss."""
    # [B, T, V] → [B·T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
                           reduction=reduction)


class PathLearner:
    """Trains one path: a model, its inner optimiser, its data stream and step count.

    The model's device is the learner's device: batches are copied there (pinned,
    asynchronous). ``cfg.precision`` autocasts the forward pass only: parameters and AdamW
    state stay fp32 (the masters DiLoCo takes pseudo-gradients of); fp16 adds a loss
    scaler. ``cfg.micro_batches`` splits each step's batch and accumulates gradients, the
    loss of each slice weighted by its share of the step's target tokens, so the update
    is that of the whole batch.

    Args:
        path_id: the path this learner trains.
        model: the path's model (a :class:`modules.PathModel`, or the dense model).
        stream: yields ``(x, y)`` batches; needs ``next_batch``, ``state_dict``, ``load_state_dict``.
        cfg: inner-loop settings.
        total_steps: inner steps over the whole run (sets the cosine schedule).
        grad_sync: called after backward, before clipping; averages gradients over the
            worker group when it has more than one rank (data parallel inside a path).
        log_every: per-step health metrics every this many steps (``logging.every_steps``;
            0: none): each turn's intervals wait in :meth:`take_intervals`.
    """

    def __init__(self, path_id: int, model: nn.Module, stream: Any, cfg: TrainerConfig,
                 total_steps: int, grad_sync: Optional[Callable[[list[torch.Tensor]], None]] = None,
                 step_offset: int = 0, log_every: int = 0) -> None:
        self.path_id = path_id
        self.model = model
        self.stream = stream
        self.cfg = cfg
        self.total_steps = total_steps
        self.grad_sync = grad_sync
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.optimizer = make_inner_optimizer(model, cfg)
        self.scaler = grad_scaler(self.device, cfg.precision)
        if cfg.activation_checkpointing:
            set_activation_checkpointing(model, True)
        # the compiled wrapper shares the model's parameters; state dicts use self.model.
        # Sharded (fsdp) paths stay eager: compile over FSDP2 modules is untested here, and
        # validation refuses an explicit trainer.compile=true with fsdp, so "auto" (on for
        # CUDA) must not switch it on behind the user's back.
        compiled = compile_enabled(cfg.compile, self.device) and not self.sharded
        self.forward = maybe_compile(model, compiled, cfg.compile_backend)
        self.step = 0
        # Steps already taken before this learner (the dense warm-up): the schedule of a
        # warm-started path continues where the warm-up left it.
        self.step_offset = step_offset
        self.log_every = log_every
        self._intervals: list[dict[str, Any]] = []

    def take_intervals(self) -> list[dict[str, Any]]:
        """The logging intervals of the turns since the last call (:class:`TurnLog`)."""
        out, self._intervals = self._intervals, []
        return out

    def _loss_and_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step's batch (in micro-batches); the mean loss."""
        mb = max(1, int(self.cfg.micro_batches))
        if mb == 1:
            with autocast(self.device, self.cfg.precision):
                logits = self.forward(to_device(x, self.device))
            loss = lm_loss(logits, to_device(y, self.device))
            self._backward(loss)
            return loss.detach()
        # Σ over slices of (slice's summed loss / step's target tokens) = the batch mean
        n_targets = (y != -100).sum()
        total = torch.zeros((), device=self.device)
        for xs, ys in zip(x.chunk(mb), y.chunk(mb)):
            with autocast(self.device, self.cfg.precision):
                logits = self.forward(to_device(xs, self.device))
            loss = lm_loss(logits, to_device(ys, self.device), reduction="sum") / n_targets.to(self.device)
            self._backward(loss)
            total += loss.detach()
        return total

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def train_steps(self, n: int, on_step: Optional[Callable[[], None]] = None,
                    should_stop: Optional[Callable[[], bool]] = None) -> InnerStats:
        """Run ``n`` inner steps; return tokens (α), mean loss and time.

        ``on_step()`` runs after each step (applied or skipped); ``should_stop()`` after
        each step ends the turn early when it returns True (decoupled mode's dynamic
        steps). Loss, gradient norm and the skip flag of each step stay on the device and
        are read once, at the end of the turn (:class:`TurnLog`).
        """
        self.model.train()
        t0 = time.perf_counter()
        turn = TurnLog(self.device, n, self.log_every, self.step)
        gated = self._gate_on_device()
        for _ in range(n):
            lr = lr_at(self.step + self.step_offset, self.total_steps, self.cfg)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            t_data = time.perf_counter()
            x, y = self.stream.next_batch()
            data_s = time.perf_counter() - t_data  # torchtitan's data-loading time
            self.optimizer.zero_grad(set_to_none=True)
            loss = self._loss_and_backward(x, y)
            if self.grad_sync is not None:
                self.grad_sync(self.params)
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)  # clip and check the true gradients
            # max_norm=inf scales by exactly 1.0: the norm is still computed, for the check below
            clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
            # sharded (fsdp) gradients give a DTensor norm: the whole group's norm, same on every rank
            norm = full_value(torch.nn.utils.clip_grad_norm_(self.params, clip))
            self.step += 1
            # One NaN/inf gradient would poison AdamW's moments and so every later step of
            # this path: such a step is skipped. After grad_sync every rank of the worker
            # group sees the same norm, so they all skip together.
            bad = ~torch.isfinite(norm)
            if gated:
                self._step_unless(bad)
            elif bool(bad):
                self.optimizer.zero_grad(set_to_none=True)
                if self.scaler is not None:
                    self.scaler.update()  # fp16: the scaler lowers its scale, as its own skip would
            elif self.scaler is None:
                self.optimizer.step()
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            turn.add(loss, norm, bad, int((y != -100).sum()), lr, self.step, data_s)  # y: host batch, no device read
            if on_step is not None:
                on_step()
            if should_stop is not None and should_stop():
                break
        stats = turn.read()  # the turn's one device → host read
        stats.seconds = time.perf_counter() - t0
        self._intervals.extend(stats.intervals)
        return stats

    def _gate_on_device(self) -> bool:
        """Whether a non-finite step is skipped on the device: the fused AdamW (CUDA) takes
        a ``found_inf`` flag, skips the update of the parameters and moments when it is set
        and takes its step count back, so nothing is read on the host. Otherwise (the CPU's
        AdamW, fp16's loss scaler, FSDP-sharded parameters) the flag is read each step: on
        the CPU that read costs nothing."""
        fused = bool(self.optimizer.defaults.get("fused"))
        return fused and self.scaler is None and not self.sharded

    def _step_unless(self, bad: torch.Tensor) -> None:
        """One fused AdamW step that is a no-op where ``bad`` (a device flag) is set."""
        # the optimiser reads these attributes in step(), as torch's GradScaler sets them
        self.optimizer.found_inf = bad.to(torch.float32)
        self.optimizer.grad_scale = None
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf, self.optimizer.grad_scale

    @property
    def sharded(self) -> bool:
        """Whether the path's parameters are FSDP-sharded (``launcher.group_parallel=fsdp``)."""
        return any(is_sharded(p) for p in self.params)

    def state_dict(self) -> dict[str, Any]:
        """Inner optimiser state, step count and data position (checkpointed per path).

        Sharded: the AdamW moments are gathered whole (a collective: every rank of the
        worker group calls it), so the file does not depend on the group size.
        """
        opt = self.optimizer.state_dict()
        if self.sharded:
            opt = full_optimizer_state(opt)
        state = {"optimizer": opt, "step": self.step,
                 "stream": self.stream.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (sharded: this rank keeps its rows of each moment)."""
        opt = state["optimizer"]
        if self.sharded:
            opt = shard_optimizer_state(opt, [p for g in self.optimizer.param_groups for p in g["params"]])
        self.optimizer.load_state_dict(opt)
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.stream.load_state_dict(state["stream"])
