"""Reusing an existing tokenizer (``data.tokenizer=PATH``): loading, its EOS, the model's
vocabulary size, and a tiny run that routes, trains, scores and exports (``--format hf``)
with it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dipaco.cli.infer import main as infer_main
from dipaco.config import ConfigError
from dipaco.job.preflight import compose  # compose_config plus model.vocab_size from data.tokenizer
from dipaco.data import DataError, Tokenizer
from dipaco.inference import InferenceRun
from dipaco.job.train import train

SMOKE = ["experiment=smoke", "launcher=local", "grid.levels=[2,2]", "trainer.rounds=1",
         "trainer.dense_baseline=false", "trainer.plots=false", "trainer.progress=false",
         "data.max_documents=120"]
TEXTS = [f"def f{i}(x):\n    return x * {i} + len('{'ab' * i}')\n" for i in range(200)]


def foreign_tokenizer(directory: Path, special: list[str], vocab_size: int = 300,
                      eos_in_config: str | None = None) -> Path:
    """A tokenizer made elsewhere (not by dipaco): byte-level BPE with its own special tokens,
    saved in the layout of a transformers tokenizer directory."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    if eos_in_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos_in_config}}))
    return directory


def test_eos_comes_from_the_config_or_a_known_name_or_is_refused(tmp_path: Path) -> None:
    llama_like = Tokenizer.load(foreign_tokenizer(tmp_path / "a", ["<unk>", "<s>", "</s>"]) / "tokenizer.json")
    assert llama_like.eos_token == "</s>" and llama_like.eos_id == 2
    custom = Tokenizer.load(foreign_tokenizer(tmp_path / "b", ["<pad>", "<|doc|>"], eos_in_config="<|doc|>"))
    assert custom.eos_token == "<|doc|>" and custom.eos_id == 1
    # saved elsewhere, it keeps its EOS (a tokenizer_config.json goes beside it) and its bytes
    custom.save(tmp_path / "run")
    again = Tokenizer.load(tmp_path / "run")
    assert (again.eos_token, again.sha256) == (custom.eos_token, custom.sha256)
    with pytest.raises(DataError, match="no end-of-sequence token"):
        Tokenizer.load(foreign_tokenizer(tmp_path / "c", ["<pad>"]))
    with pytest.raises(DataError, match="does not hold"):
        Tokenizer.load(foreign_tokenizer(tmp_path / "d", ["</s>"], eos_in_config="<|missing|>"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="save_pretrained"):
        Tokenizer.load(tmp_path / "empty")


def test_model_vocab_size_follows_the_tokenizer_unless_given(tmp_path: Path) -> None:
    tok_dir = foreign_tokenizer(tmp_path / "tok", ["</s>"], vocab_size=290)
    size = Tokenizer.load(tok_dir).vocab_size
    cfg = compose(SMOKE + [f"data.tokenizer={tok_dir}"], tmp_path / "r1")
    assert cfg.model.vocab_size == size != compose(SMOKE).model.vocab_size
    given = compose(SMOKE + [f"data.tokenizer={tok_dir}", "model.vocab_size=280"], tmp_path / "r2")
    assert given.model.vocab_size == 280  # above the byte-level minimum, below the tokenizer
    with pytest.raises(ConfigError, match=f"model.vocab_size: 280 cannot hold the {size} token ids"):
        train(given)
    assert not (tmp_path / "r2" / "tokenizer.json").exists()


@pytest.mark.slow
def test_route_train_score_with_a_reused_tokenizer(tmp_path: Path, capsys) -> None:
    tok_dir = foreign_tokenizer(tmp_path / "tok", ["<pad>", "<|doc|>"], vocab_size=400, eos_in_config="<|doc|>")
    reused = Tokenizer.load(tok_dir)
    run_dir = tmp_path / "run"
    summary = train(compose(SMOKE + [f"data.tokenizer={tok_dir}"], run_dir))
    assert np.isfinite(summary["routed_ppl"]) and summary["routed_ppl"] > 1.0
    # the run holds the very same tokenizer (bytes) and the model is sized for it
    assert (run_dir / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert f"vocab_size: {reused.vocab_size}" in (run_dir / "config.yaml").read_text()
    run_tok = Tokenizer.load(run_dir)
    assert (run_tok.eos_token, run_tok.vocab_size) == ("<|doc|>", reused.vocab_size)

    def cli(*argv: str) -> dict:
        capsys.readouterr()  # drop the trainer's log lines
        infer_main([str(a) for a in argv])
        return json.loads(capsys.readouterr().out.splitlines()[0])

    routed = cli("route", run_dir, "--text", TEXTS[3])
    assert 0 <= routed["path_id"] < 4
    scored = cli("score", run_dir, "--validation")
    assert np.isclose(scored["ppl"], summary["routed_ppl"], rtol=1e-9)
    # resuming with another tokenizer is refused before anything is read: the run keeps its own
    other = foreign_tokenizer(tmp_path / "other", ["</s>"], vocab_size=350)
    with pytest.raises(ConfigError, match="data.tokenizer: .* would change the run"):
        train(compose(SMOKE + [f"data.tokenizer={other}", "resume=true",
                                      f"model.vocab_size={reused.vocab_size}"], run_dir))
    # the path as a Llama checkpoint, with the reused tokenizer's files and EOS
    transformers = pytest.importorskip("transformers")
    cli("export", run_dir, "--path", routed["path_id"], "--out", tmp_path / "hf", "--format", "hf")
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf_tok.eos_token, hf_tok.eos_token_id) == ("<|doc|>", run_tok.eos_id)
    ids = torch.tensor([hf_tok(TEXTS[3], add_special_tokens=False)["input_ids"]])
    assert ids.tolist()[0] == run_tok.encode(TEXTS[3])
    with torch.no_grad():
        ours = InferenceRun.open(run_dir, device="cpu").loader().get(routed["path_id"])(ids)
        torch.testing.assert_close(llama(ids).logits, ours, atol=2e-5, rtol=1e-4)
