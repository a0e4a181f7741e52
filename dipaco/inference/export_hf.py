"""One path as a Hugging Face Llama checkpoint (``dipaco-infer export --format hf``).

A path is Llama's architecture: token embedding → pre-norm blocks (RMSNorm → causal
attention with rotary positions → residual; RMSNorm → SwiGLU → residual) → final
RMSNorm → vocabulary projection, without biases. Detail by detail (modules/layers.py):

* rotary: dipaco rotates channel ``i`` with channel ``i + head_dim/2`` ("split halves"),
  with frequencies ``theta^(-2i/head_dim)``: exactly ``transformers``' ``rotate_half``
  with the default rope, so q/k rows are copied as they are (no interleave permutation);
  ``rope_theta`` carries over.
* RMSNorm: ``weight * x / sqrt(mean(x²) + eps)`` in fp32, weight a plain gain (not
  ``1 + w``): Llama's ``LlamaRMSNorm`` with ``rms_norm_eps = norm_eps``.
* attention: one fused ``qkv`` projection, rows ``[q; k; v]``, split into
  ``q_proj``/``k_proj``/``v_proj``; as many key/value heads as query heads (no GQA);
  ``head_dim = d_model / n_heads``; scores scaled by ``head_dim^-0.5`` as in SDPA.
* SwiGLU: ``down(silu(gate(x)) * up(x))`` = Llama's MLP with ``hidden_act="silu"``.
* tied embeddings: ``tie_word_embeddings`` and no ``lm_head.weight`` in the file.

Every parameter of the path is mapped by name; one that has no Llama counterpart (an
architecture change dipaco may grow) is refused with :class:`ExportError`, never dropped.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dipaco.storage.atomic import write_json
from dipaco.storage.tensor_io import save_tensors
from dipaco.inference.export import EXPORT_MARKER, check_export_target, staged_export
from dipaco.inference.model_card import MODEL_CARD, PROVENANCE_FILE, TRAINING_CONFIG, write_hf_extras
from dipaco.inference.run import InferenceRun
from modules import ModelConfig, PathModel

# dipaco parameter name (inside a level module's block) → Llama's, under model.layers.<i>.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
# The top-level files of a one-path Hugging Face export (what --force may replace).
HF_EXPORT_FILES = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", MODEL_CARD, TRAINING_CONFIG,
                   PROVENANCE_FILE, EXPORT_MARKER)
_BLOCK_KEY = re.compile(r"levels\.(\d+)\.blocks\.(\d+)\.(.+)")


class ExportError(ValueError):
    """A path that cannot be written as a Llama checkpoint; the message says why."""


def llama_config(cfg: ModelConfig, num_layers: int, eos_id: int) -> dict[str, Any]:
    """``config.json`` of ``LlamaForCausalLM`` for a path of ``num_layers`` blocks."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "initializer_range": cfg.init_std,
        "bos_token_id": None,
        "eos_token_id": int(eos_id),
        "pad_token_id": None,
        "torch_dtype": "float32",
    }


def llama_state_dict(model: PathModel) -> dict[str, torch.Tensor]:
    """The path's weights under Llama's parameter names (fp32); refuses any unmapped parameter."""
    cfg = model.cfg
    C = cfg.d_model
    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        t = p.detach().to(torch.float32)
        m = _BLOCK_KEY.fullmatch(name)
        if name == "embed.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "head.norm.weight":
            out["model.norm.weight"] = t
        elif name == "head.proj.weight":
            out["lm_head.weight"] = t
        elif m and m.group(3) == "attn.qkv.weight":
            layer = int(m.group(1)) * cfg.layers_per_level + int(m.group(2))
            if t.shape != (3 * C, C):
                raise ExportError(f"{name} has shape {tuple(t.shape)}, not [3*d_model, d_model]: "
                                  "Llama's q/k/v projections cannot hold it")
            for part, rows in zip(("q", "k", "v"), t.split(C, dim=0)):
                out[f"model.layers.{layer}.self_attn.{part}_proj.weight"] = rows
        elif m and m.group(3) in _BLOCK_NAMES:
            layer = int(m.group(1)) * cfg.layers_per_level + int(m.group(2))
            out[f"model.layers.{layer}.{_BLOCK_NAMES[m.group(3)]}"] = t
        else:
            raise ExportError(f"path parameter {name!r} has no counterpart in a Llama checkpoint; "
                              "this path's architecture cannot be exported with --format hf")
    return out


def write_llama_files(model: PathModel, tokenizer: Any, out: Path) -> None:
    """Write ``model`` (one path) and ``tokenizer`` into the folder ``out`` (staging: the
    caller moves it in) as a Llama directory that ``transformers.LlamaForCausalLM`` and
    ``AutoTokenizer`` load."""
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ExportError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{model.cfg.vocab_size} embedding rows")
    tensors = llama_state_dict(model)
    num_layers = len(model.levels) * model.cfg.layers_per_level
    out.mkdir(parents=True, exist_ok=True)
    save_tensors(out / "model.safetensors", tensors, meta={"format": "pt"})
    write_json(out / "config.json", llama_config(model.cfg, num_layers, tokenizer.eos_id))
    write_json(out / "generation_config.json", {"eos_token_id": int(tokenizer.eos_id)})
    tokenizer.save_pretrained(str(out), model_max_length=model.cfg.max_seq_len)


def write_llama(model: PathModel, tokenizer: Any, out_dir: str | os.PathLike, *, overwrite: bool = False,
                extras: Optional[Callable[[Path], None]] = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a Llama export in ``out_dir`` (``extras(staging)``
    adds the model card and provenance), by the export rule: staged, then moved in;
    ``overwrite`` replaces only the files an earlier export wrote."""
    out = Path(out_dir).expanduser().resolve()
    check_export_target(out, overwrite, HF_EXPORT_FILES)
    with staged_export(out, overwrite) as staging:  # a reader never sees a half-written checkpoint
        write_llama_files(model, tokenizer, staging)
        if extras is not None:
            extras(staging)
        (staging / EXPORT_MARKER).write_text("dipaco-hf v1\n", encoding="utf-8")
    return out


def export_path_hf(run: InferenceRun, path_id: int, out_dir: str | os.PathLike, *,
                   overwrite: bool = False) -> Path:
    """Write path ``path_id`` of ``run`` as a Hugging Face Llama checkpoint; return the directory."""
    model = run.loader().get(int(path_id))
    return write_llama(model, run.tokenizer, out_dir, overwrite=overwrite,
                       extras=lambda d: write_hf_extras(run, d, [int(path_id)], routed=False))


__all__ = ["ExportError", "HF_EXPORT_FILES", "export_path_hf", "llama_config", "llama_state_dict", "write_llama",
           "write_llama_files"]
