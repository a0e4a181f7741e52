"""The tokenizer: the only module that imports HF ``tokenizers``.

By default a byte-level BPE is trained on the corpus: every string (any language,
emoji, stray control characters) encodes without an unknown token and
``decode(encode(text)) == text``; training is local and offline (no vocabulary is
downloaded). ``data.tokenizer=PATH`` reuses an existing HF ``tokenizer.json`` or a local
``transformers`` tokenizer directory instead (:meth:`Tokenizer.load`). Either way one
end-of-sequence token (:attr:`eos_id`) separates documents in the training stream.

The serialized JSON is kept byte for byte, so :attr:`Tokenizer.sha256` is the same after
``save``/``load`` and serves as the tokenizer's cache key.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dipaco.data.errors import DataError
from dipaco.storage.atomic import atomic_write_text
from dipaco.storage.hashing import sha256_hex
from dipaco.storage.strict_json import dumps_strict

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
# Where transformers keeps a tokenizer's special tokens (eos_token among them).
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# The end-of-sequence tokens of common tokenizer families (GPT-2/NeoX, Llama 1-2/T5,
# Llama 3, Gemma), used when no tokenizer_config.json names one.
_KNOWN_EOS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


class Tokenizer:
    """A HF ``tokenizers`` tokenizer with a known end-of-sequence token."""

    def __init__(self, hf: _HFTokenizer, json_str: str | None = None, eos_token: str = EOS_TOKEN) -> None:
        """Wrap a HF tokenizer (use :meth:`train` or :meth:`load` rather than this)."""
        self._tok = hf
        self._json = json_str if json_str is not None else hf.to_str()
        eos = hf.token_to_id(eos_token)
        if eos is None:
            raise DataError(f"the tokenizer has no {eos_token} token. Fix: train it with Tokenizer.train")
        self._eos_id = int(eos)
        self._eos_token = eos_token

    # ---------------------------------------------------------------- build / persist

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> "Tokenizer":
        """Train a byte-level BPE of at most ``vocab_size`` tokens on ``texts``.

        The same texts in the same order give the same tokenizer (same :attr:`sha256`).
        The vocabulary may come out smaller than asked when the texts hold fewer merges.
        """
        if vocab_size < 256 + 1:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: a byte-level BPE needs 256 byte tokens "
                f"plus {EOS_TOKEN}. Fix: use at least 257 (e.g. 2048)"
            )
        hf = _HFTokenizer(models.BPE())
        # add_prefix_space=False: no space is invented, so decode(encode(x)) == x exactly
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOS_TOKEN],  # id 0
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator((t for t in texts if t), trainer=trainer)
        return cls(hf)

    def save(self, path: str) -> str:
        """Write the tokenizer JSON atomically and return the file written.

        ``path`` ending in ``.json`` is the file; anything else is a directory (created if
        needed) that receives ``tokenizer.json``. When the end-of-sequence token is not
        ``<|endoftext|>``, a ``tokenizer_config.json`` naming it is written beside, so
        :meth:`load` finds the same token again.
        """
        path = os.fspath(path)
        if not path.endswith(".json"):
            path = os.path.join(path, TOKENIZER_FILE)
        atomic_write_text(path, self._json)
        if self._eos_token != EOS_TOKEN:
            atomic_write_text(os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE),
                          dumps_strict({"eos_token": self._eos_token}, indent=2) + "\n")
        return path

    def save_pretrained(self, directory: str, *, model_max_length: int) -> None:
        """Write the files ``transformers.AutoTokenizer.from_pretrained(directory)`` reads:
        ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
        self.save(directory)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": self._eos_token,
                  "model_max_length": int(model_max_length), "clean_up_tokenization_spaces": False}
        atomic_write_text(os.path.join(directory, TOKENIZER_CONFIG_FILE), dumps_strict(config, indent=2) + "\n")
        atomic_write_text(os.path.join(directory, "special_tokens_map.json"),
                      dumps_strict({"eos_token": self._eos_token}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load a HF ``tokenizer.json`` (``path``: the file or a directory holding it).

        Works for files written by :meth:`save` and for existing tokenizers, e.g. a local
        ``transformers`` tokenizer directory (fast tokenizers keep a ``tokenizer.json``).
        The end-of-sequence token is the ``eos_token`` of a ``tokenizer_config.json``
        beside the file, else the first of ``<|endoftext|>``, ``</s>``,
        ``<|end_of_text|>``, ``<eos>`` that the vocabulary holds; a tokenizer with none
        is refused (:class:`DataError`).
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer file {path} not found. Fix: train one (Tokenizer.train), point at an existing "
                f"run, or, for a transformers tokenizer without one, save it with "
                f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
            )
        try:
            with open(path, "r", encoding="utf-8") as f:
                json_str = f.read()
            hf = _HFTokenizer.from_str(json_str)
        except Exception as e:  # UnicodeDecodeError, serde errors from Rust, ...
            first = (str(e).strip().splitlines() or [""])[0]
            raise DataError(
                f"tokenizer file {path} is corrupt ({type(e).__name__}: {first}). "
                f"Fix: delete it and train again, or point data.tokenizer at a valid tokenizer.json"
            ) from None
        return cls(hf, json_str, eos_token=_find_eos(hf, path))

    # ---------------------------------------------------------------- use

    def encode(self, text: str) -> List[int]:
        """Token ids of one text (no eos added: the batcher adds it between documents)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts (Rust-parallel when TOKENIZERS_PARALLELISM allows)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """Token ids of many texts laid end to end (int32) and each text's count (int64):
        what the token store appends. The fast batch encoder skips the character offsets,
        which only alignment needs; the ids are the same."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        ids = [e.ids for e in encode(list(texts), add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids; ``<|endoftext|>`` is kept unless ``skip_special_tokens``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including ``<|endoftext|>``): the model's vocabulary size."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token, the document separator."""
        return self._eos_id

    @property
    def eos_token(self) -> str:
        """The end-of-sequence token (``<|endoftext|>`` for a trained BPE)."""
        return self._eos_token

    @property
    def sha256(self) -> str:
        """Hex sha256 of the saved JSON: the tokenizer's identity in cache keys."""
        return sha256_hex(self._json)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, sha256={self.sha256[:12]})"


def tokenizer_beside(data: Any) -> Optional[str]:
    """The ``tokenizer.json`` beside pre-tokenized data (``data=tokens``): in ``data.path``
    when it is a directory, else beside the file it names; None when there is none."""
    if not getattr(data, "path", None):
        return None
    path = os.path.expanduser(str(data.path))
    for d in (path, os.path.dirname(path)):
        if os.path.isdir(d) and os.path.isfile(os.path.join(d, TOKENIZER_FILE)):
            return os.path.join(d, TOKENIZER_FILE)
    return None


def _find_eos(hf: _HFTokenizer, path: str) -> str:
    """The end-of-sequence token of the tokenizer at ``path`` (see :meth:`Tokenizer.load`)."""
    config_path = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG_FILE)
    if os.path.isfile(config_path):
        try:
            with open(config_path, "r", encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{config_path} is not a JSON object ({type(e).__name__}). Fix: repair or remove it") from None
        if isinstance(eos, dict):  # transformers' AddedToken form: {"content": "</s>", ...}
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            if hf.token_to_id(eos) is None:
                raise DataError(f"{config_path} names eos_token {eos!r}, which {path} does not hold. "
                                "Fix: name a token of the vocabulary")
            return eos
    for token in _KNOWN_EOS:
        if hf.token_to_id(token) is not None:
            return token
    raise DataError(
        f"tokenizer {path} has no end-of-sequence token (no eos_token in a {TOKENIZER_CONFIG_FILE} beside "
        f"it, none of {', '.join(_KNOWN_EOS)} in its vocabulary); documents need one as separator. "
        f"Fix: add {TOKENIZER_CONFIG_FILE} with {{\"eos_token\": \"...\"}} naming one of its tokens"
    )
