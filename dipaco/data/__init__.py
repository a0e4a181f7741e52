"""Data: corpus loading, the built-in offline corpus, tokenizer, tokenization cache, batches.

raw documents → :func:`load_corpus` (a :class:`Corpus`: streamed into a text store on disk,
read as :class:`Documents` views with ``id``, ``text``, ``label``, ``group``, ``split``) →
:class:`Tokenizer` → :func:`tokenize_to_docs` (every core, into a memory-mapped
``router.TokenDocs``, cached) → :class:`TokenStream` batches for one path's shard.
Pre-tokenized input (``data=tokens``) is :func:`load_token_corpus`.

Names are re-exported lazily (PEP 562): ``from dipaco.data import split_of`` does not pay
for importing torch, datasets and tokenizers, which matters for CLIs that only print an
error and for worker processes.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "batches": ("IGNORE_INDEX", "PathBatcher", "TokenStream", "build_stream", "iter_eval_batches",
                "tokens_in_batch"),
    "corpus": ("DOCUMENT_FEATURES", "SOURCES", "Corpus", "load_corpus"),
    "pretokenized": ("TokenCorpus", "load_token_corpus"),
    "textstore": ("Documents",),
    "errors": ("DataError",),
    "multidomain": ("DOMAINS", "DomainDocument", "load_multidomain"),
    "python_sources": ("SourceDocument", "iter_python_sources", "list_source_files", "split_source",
                       "stdlib_root"),
    "splits": ("SPLITS", "split_of"),
    "tokenize": ("CACHE_STATS", "dataset_content_hash", "dataset_token_stream", "progress_bars",
                 "tokenize_dataset", "tokenize_to_docs"),
    "tokenizer": ("EOS_TOKEN", "Tokenizer"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dipaco.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dipaco.data.{module}"), name)
    globals()[name] = value  # next access skips __getattr__
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers and IDEs see the real names
    from dipaco.data.batches import (IGNORE_INDEX, PathBatcher, TokenStream, build_stream,
                                     iter_eval_batches, tokens_in_batch)
    from dipaco.data.corpus import DOCUMENT_FEATURES, SOURCES, Corpus, load_corpus
    from dipaco.data.pretokenized import TokenCorpus, load_token_corpus
    from dipaco.data.textstore import Documents
    from dipaco.data.errors import DataError
    from dipaco.data.multidomain import DOMAINS, DomainDocument, load_multidomain
    from dipaco.data.python_sources import (SourceDocument, iter_python_sources, list_source_files,
                                            split_source, stdlib_root)
    from dipaco.data.splits import SPLITS, split_of
    from dipaco.data.tokenize import (CACHE_STATS, dataset_content_hash, dataset_token_stream, progress_bars,
                                      tokenize_dataset, tokenize_to_docs)
    from dipaco.data.tokenizer import EOS_TOKEN, Tokenizer
