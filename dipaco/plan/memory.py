"""Memory model of one rank: what ``dipaco-plan`` prints before a run is launched.

Per rank (a worker group's rank; the local backend is one process playing every group):

* **parameters**: fp32 weights of every module the rank holds (the union of its paths'
  modules: paths share module objects, so a shared module is counted once);
* **gradients**: fp32, one per held parameter (a path's gradients stay allocated until
  its next step, so after a turn every held module may carry one);
* **optimiser**: AdamW's two fp32 moments per parameter *per path* (each path has its own
  inner optimiser, DESIGN contract 3);
* **activations**: what autograd keeps for backward in one micro-batch of
  ``batch_size / group_size / micro_batches`` sequences of ``seq_len`` tokens. Counted
  from ``modules/layers.py`` (elements per token): per block the input, two RMSNorms
  (normalised + scaled, 2·d each), the qkv output (3·d), the rotated q and k (2·d), the
  attention output and its contiguous copy (2·d), the second residual (d) and SwiGLU's
  gate, silu, up and product (4·h), i.e. ``13·d + 4·h``; the head keeps the logits and
  their log-softmax and backward adds their gradient (``3·V``, fp32 whatever the
  autocast, since the loss upcasts). Low precision halves the block terms. With
  activation checkpointing a block keeps only its input, and one block's activations
  are rebuilt at a time during backward;
* **outer state**: per held module its fp32 global weights, outer momentum, outer
  gradient, round buffer and the running sum behind the round's cosine-similarity report
  (5 × 4 bytes per parameter). It is on the device (``outer_on_device``) where the sync keeps
  it next to the modules (``diloco.outer_device=auto``, codec ``none``, not sharded: see
  :func:`outer_on_device`), otherwise in host memory.

With ``launcher.group_parallel=fsdp`` (``shards`` = G) each rank keeps 1/G of the
parameters, gradients, AdamW moments and outer state (:mod:`dipaco.sync.fsdp`), plus one
whole fp32 module while FSDP2 has it all-gathered for its forward or backward (the
largest held module is counted; FSDP2's prefetch of the next one is not).

The model leaves out the allocator's slack, temporary buffers of single kernels and
the framework's own footprint; ``benchmarks/bench_gpu.py`` compares it with a measured
peak (``docs/gpu.md``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from modules import ModelConfig

FP32 = 4


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs, by kind (``device`` is what sits on its GPU in a GPU run)."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    outer: int
    outer_on_device: bool = False  # diloco.outer_device=auto on a GPU: the outer state is there too

    @property
    def device(self) -> int:
        """Parameters, gradients, AdamW state and activations (and the outer state when it
        lives on the device): the rank's device memory."""
        inner = self.parameters + self.gradients + self.optimizer + self.activations
        return inner + (self.outer if self.outer_on_device else 0)

    @property
    def total(self) -> int:
        """Device plus any host-side outer state (the whole footprint of a CPU run)."""
        return self.device + (0 if self.outer_on_device else self.outer)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view, with the two totals."""
        return {**asdict(self), "device": self.device, "total": self.total}


def activation_bytes(model: ModelConfig, num_levels: int, sequences: int, seq_len: int, *,
                     low_precision: bool = False, checkpointing: bool = False) -> int:
    """Bytes autograd keeps for one forward of ``sequences × seq_len`` tokens of a path."""
    tokens = sequences * seq_len
    d, h, V = model.d_model, model.hidden_dim, model.vocab_size
    act = 2 if low_precision else FP32
    per_block = (13 * d + 4 * h) * act * tokens
    blocks = num_levels * model.layers_per_level
    embed = d * act * tokens
    head = (2 * d * FP32 + 3 * V * FP32) * tokens  # final norm in fp32; logits, log-softmax, their grad
    if checkpointing:
        kept = blocks * d * act * tokens + per_block  # block inputs + one block rebuilt in backward
    else:
        kept = blocks * per_block
    return int(embed + kept + head)


def outer_on_device(cfg: Any) -> bool:
    """Whether a GPU run of ``cfg`` keeps the outer state on the GPU (the rule of
    :meth:`dipaco.sync.diloco.DiLoCoSync._state_device`, for a rank on a GPU)."""
    d = cfg.diloco
    return (d.outer_device == "auto" and d.codec == "none" and d.mode == "sync"
            and cfg.launcher.group_parallel != "fsdp")


def rank_memory(model: ModelConfig, num_levels: int, held_params: int, path_params: list[int], *,
                sequences: int, seq_len: int, low_precision: bool = False,
                checkpointing: bool = False, shards: int = 1, gathered_params: int = 0,
                outer_on_device: bool = False) -> RankMemory:
    """The :class:`RankMemory` of a rank holding ``held_params`` parameters and training
    paths of ``path_params`` parameters each, ``sequences`` per micro-batch.

    ``shards``: G under ``group_parallel=fsdp`` (1: replicated); ``gathered_params``: the
    parameters of the largest module, held whole while FSDP2 has it all-gathered.
    """
    return RankMemory(
        parameters=FP32 * (held_params // shards + (gathered_params if shards > 1 else 0)),
        gradients=FP32 * held_params // shards,
        optimizer=2 * FP32 * sum(path_params) // shards,
        activations=activation_bytes(model, num_levels, sequences, seq_len, low_precision=low_precision,
                                     checkpointing=checkpointing),
        outer=5 * FP32 * held_params // shards,
        outer_on_device=outer_on_device,
    )
