"""A byte-level BPE tokenizer: the only module that imports HF ``tokenizers``.

Byte-level means every string (any language, emoji, stray control characters) encodes
without an unknown token and ``decode(encode(text)) == text``. Training is local and
offline (no vocabulary is downloaded). The special token ``<|endoftext|>`` (:attr:`eos_id`)
separates documents in the training stream.

The serialized JSON is kept byte for byte, so :attr:`Tokenizer.sha256` is the same after
``save``/``load`` and serves as the tokenizer's cache key.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterable, List, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from dipaco.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Byte-level BPE with one special token, ``<|endoftext|>``."""

    def __init__(self, hf: _HFTokenizer, json_str: str | None = None) -> None:
        """Wrap a HF tokenizer (use :meth:`train` or :meth:`load` rather than this)."""
        self._tok = hf
        self._json = json_str if json_str is not None else hf.to_str()
        eos = hf.token_to_id(EOS_TOKEN)
        if eos is None:
            raise DataError(f"the tokenizer has no {EOS_TOKEN} token. Fix: train it with Tokenizer.train")
        self._eos_id = int(eos)

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
        needed) that receives ``tokenizer.json``.
        """
        path = os.fspath(path)
        if not path.endswith(".json"):
            path = os.path.join(path, TOKENIZER_FILE)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._json)
            os.replace(tmp, path)  # a reader never sees half a file
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load a tokenizer saved by :meth:`save` (``path``: the file or its directory)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise DataError(
                f"tokenizer file {path} not found. Fix: train one (Tokenizer.train) or point at an existing run"
            )
        try:
            with open(path, "r", encoding="utf-8") as f:
                json_str = f.read()
            hf = _HFTokenizer.from_str(json_str)
        except Exception as e:  # UnicodeDecodeError, serde errors from Rust, ...
            first = (str(e).strip().splitlines() or [""])[0]
            raise DataError(
                f"tokenizer file {path} is corrupt ({type(e).__name__}: {first}). "
                f"Fix: delete it and train again"
            ) from None
        return cls(hf, json_str)

    # ---------------------------------------------------------------- use

    def encode(self, text: str) -> List[int]:
        """Token ids of one text (no eos added: the batcher adds it between documents)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of many texts (Rust-parallel when TOKENIZERS_PARALLELISM allows)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids; ``<|endoftext|>`` is kept unless ``skip_special_tokens``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including ``<|endoftext|>``): the model's vocabulary size."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        """Id of ``<|endoftext|>``, the document separator."""
        return self._eos_id

    @property
    def sha256(self) -> str:
        """Hex sha256 of the saved JSON: the tokenizer's identity in cache keys."""
        return hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, sha256={self.sha256[:12]})"
