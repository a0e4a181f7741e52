"""router: documents (token ids) → paths of a DiPaCo grid, and training shards on disk.

Leaf package: imports numpy, faiss (in ``router.kmeans`` only), scikit-learn and
datasets — never torch, ``dipaco`` or ``modules``. LM features arrive as a callable
(:class:`CallableFeaturizer`).

Typical use::

    r = Router.fit(token_docs, grid=[4, 4], prefix_tokens=32)
    shards = r.assign(token_docs)            # balanced, top-k, for training
    write_shards(token_docs, shards, r.num_paths, "out/shards")
    load_shard("out/shards", 3)              # path 3's documents, memory-mapped (TokenDocs)
    r.route(prompt_ids)                      # evaluation / inference: best path
    r.save("out/router"); Router.load("out/router", expected_grid=[4, 4])
"""
from .assign import balanced_assign, capacity_per_path
from .discriminative import DiscriminativeHead, fit_discriminative
from .em import RESHARD_ASSIGNS, compare_assignments, loss_assign, mean_assigned_loss, reshard_assignments
from .features import CallableFeaturizer, TokenTfidfFeaturizer
from .kmeans import fit_kmeans, search, squared_distances
from .report import routing_report
from .router import METHODS, ROUTER_FORMAT_VERSION, Router
from .shards import (
    assign_in_batches,
    expand_replicas,
    load_shard,
    read_assignments,
    read_shards_manifest,
    write_shards,
)
from .tokens import TokenDocs, TokenDocsWriter, TokenFileError, open_token_docs, write_token_docs

__all__ = [
    "Router",
    "METHODS",
    "ROUTER_FORMAT_VERSION",
    "TokenTfidfFeaturizer",
    "CallableFeaturizer",
    "fit_kmeans",
    "squared_distances",
    "search",
    "balanced_assign",
    "capacity_per_path",
    "fit_discriminative",
    "DiscriminativeHead",
    "RESHARD_ASSIGNS",
    "loss_assign",
    "reshard_assignments",
    "compare_assignments",
    "mean_assigned_loss",
    "write_shards",
    "assign_in_batches",
    "TokenDocs",
    "TokenDocsWriter",
    "TokenFileError",
    "open_token_docs",
    "write_token_docs",
    "expand_replicas",
    "load_shard",
    "read_shards_manifest",
    "read_assignments",
    "routing_report",
]
