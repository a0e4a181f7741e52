"""Shape of one path's transformer: the numbers every module of a grid is built from.

A ``ModelConfig`` describes the model that *one path* is: an embedding, ``num_levels ×
layers_per_level`` pre-norm transformer blocks, and an LM head. The grid (how many
alternative modules each level has) is not part of it; see :class:`modules.ModuleGrid`.

No ``from __future__ import annotations`` here on purpose: OmegaConf/Hydra structured
configs read these annotations as real types.
"""
from dataclasses import asdict, dataclass
from typing import Any


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass
class ModelConfig:
    """Hyper-parameters of one path (all modules of a grid share them).

    Attributes:
        vocab_size: number of token ids the embed and head modules cover.
        d_model: residual stream width.
        n_heads: attention heads per block; ``d_model`` must be divisible by it.
        layers_per_level: transformer blocks inside each level module.
        max_seq_len: longest sequence (prompt + generated tokens) a path accepts;
            sizes the rotary tables.
        mlp_hidden: SwiGLU hidden width; ``None`` → ≈ 8/3·d_model rounded up to a
            multiple of 16 (same parameter count as a 4·d GELU MLP).
        rope_theta: rotary embedding base.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: the head reuses the embed weight as its output projection.
        init_std: std of the normal init of embeddings and linear weights.
    """

    vocab_size: int = 2048
    d_model: int = 64
    n_heads: int = 2
    layers_per_level: int = 1
    max_seq_len: int = 256
    mlp_hidden: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_heads``)."""
        return self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width actually used (``mlp_hidden`` resolved)."""
        if self.mlp_hidden is not None:
            return int(self.mlp_hidden)
        # ceil(8·d/3) in integers, then up to a multiple of 16 for friendlier matmuls.
        return _round_up((8 * self.d_model + 2) // 3, 16)

    def validate(self) -> "ModelConfig":
        """Check the numbers fit together; raise ``ValueError`` naming the field and the fix.

        Returns ``self`` so it can be chained: ``cfg = ModelConfig(...).validate()``.
        """
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive integer, got {value!r}; "
                    f"set {name} to 1 or more"
                )

        for name in ("vocab_size", "d_model", "n_heads", "layers_per_level", "max_seq_len"):
            positive_int(name)
        if self.mlp_hidden is not None:
            positive_int("mlp_hidden")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick n_heads among the divisors of d_model"
            )
        if self.head_dim % 2 != 0:
            # Rotary embeddings rotate pairs of channels, so a head needs an even width.
            raise ValueError(
                f"ModelConfig head_dim = d_model / n_heads = {self.head_dim} must be even "
                f"for rotary embeddings; change d_model ({self.d_model}) or n_heads "
                f"({self.n_heads})"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(
                    f"ModelConfig.{name} must be a positive number, got {value!r}; "
                    f"set {name} > 0"
                )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(
                f"ModelConfig.tie_embeddings must be true or false, got {self.tie_embeddings!r}"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON view (for checkpoint manifests)."""
        return asdict(self)
