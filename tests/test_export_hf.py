"""``dipaco-infer export --format hf``: a path as a Llama checkpoint that ``transformers``
loads, with the same logits as dipaco's (fp32)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dipaco.data import Tokenizer
from dipaco.inference.export_hf import ExportError, write_llama
from modules import ModelConfig, ModuleGrid, PathModel

transformers = pytest.importorskip("transformers")

TEXTS = [f"def f{i}(x):\n    return x * {i} + len('{'ab' * i}')\n" for i in range(100)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, vocab_size=300)


def path_model(tie: bool, vocab_size: int) -> PathModel:
    """A path of a [2, 3] grid, 2 blocks per level, with non-default theta/eps and norm gains
    that are not all ones (so a wrong norm form or a swapped norm cannot pass)."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_heads=4, layers_per_level=2, max_seq_len=64,
                      rope_theta=500.0, norm_eps=1e-6, tie_embeddings=tie, mlp_hidden=48)
    grid = ModuleGrid(cfg, [2, 3], seed=1)
    model = PathModel(grid, 4).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_match_dipaco(tmp_path: Path, tokenizer: Tokenizer, tie: bool) -> None:
    model = path_model(tie, vocab_size=tokenizer.vocab_size + 4)  # padded rows are allowed
    out = write_llama(model, tokenizer, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["tie_word_embeddings"] is tie
    llama = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), llama(ids).logits
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(ours[:, 1:], ours[:, :1].expand_as(ours[:, 1:]))  # positions matter
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok(TEXTS[7], add_special_tokens=False)["input_ids"] == tokenizer.encode(TEXTS[7])
    assert hf_tok.eos_token_id == tokenizer.eos_id == llama.config.eos_token_id


def test_unmappable_parameter_is_refused(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model = path_model(False, vocab_size=tokenizer.vocab_size)
    model.levels[0].blocks[0].attn.proj.bias = torch.nn.Parameter(torch.zeros(32))  # Llama has none
    with pytest.raises(ExportError, match=r"'levels.0.blocks.0.attn.proj.bias' has no counterpart"):
        write_llama(model, tokenizer, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    small = path_model(False, vocab_size=tokenizer.vocab_size - 1)
    with pytest.raises(ExportError, match="embedding rows"):
        write_llama(small, tokenizer, tmp_path / "hf")
