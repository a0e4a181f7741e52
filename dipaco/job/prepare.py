"""Everything before ranks exist: corpus → tokenizer → tokens → warm-up → router → shards.

Runs once, in the launching process (faiss must fit before any rank is forked, and
every rank must read the same shards). Each step's output lands in the run directory
and is reused on ``resume=true``, so a resumed run routes exactly as the first did.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import numpy as np

from dipaco.run.checkpoint import sha256_file, write_json
from dipaco.config import Config
from dipaco.data import Tokenizer, dataset_content_hash, load_corpus, progress_bars
from dipaco.data.pretokenized import load_token_corpus
from dipaco.rounds.dense import WARMUP_STREAM_ID, load_dense_grid, save_dense, train_dense
from dipaco.rounds.early_stopping import write_validation_shards
from dipaco.run.fingerprint import Fingerprints
from dipaco.job.token_record import check_corpus, recorded_split, save_record
from dipaco.job.prepare_tokens import (_require_documents_per_path, evaluated_rows,  # noqa: F401 - re-exported
                                   peak_rss_mib, prepare_tokens, split_tokens)
from dipaco.runtime.hardware import release_free_memory
from dipaco.runtime.progress import bars_enabled, log
from dipaco.run.path_guard import resolved, writable_problem
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.config.schedule import warmup_steps
from modules.features import lm_featurizer
from router import (
    CallableFeaturizer,
    Router,
    TokenDocs,
    TokenTfidfFeaturizer,
    assign_in_batches,
    expand_replicas,
    routing_report,
    write_shards,
)
from router.methods import method_config
from router.settings import RouterSettings

# The router's featurizer and k-means are fitted on at most this many training documents
# (evenly spaced over the corpus); every document is then routed, in batches. The fit's
# memory grows with its sample (the prefixes, their TF-IDF matrix, and the SVD's work
# arrays of [terms, 74] and [documents, 74] float64, the terms growing with the documents),
# so the sample stops growing early: measured in a process of its own, +227 MB for 13,800
# prefixes of a 4 KB-document corpus, +257 MB for 16,384, +392 MB for 32,674 (the old cap,
# 262,144, let a fit on synthetic prefixes take 1.6 GB: docs/results.md §20). k-means samples at
# most 256 points per centroid anyway (16,384 = 256 x the 64 fine clusters of router=merge
# on up to 8 paths). The default run's 27,639 training documents are now a sample too.
ROUTER_FIT_MAX_DOCUMENTS = 16_384


@dataclass
class Prepared:
    """What the preparation phase produced (all also on disk in the run directory)."""

    tokenizer: Any
    train_ids: TokenDocs  # memory-mapped token ids of the training documents
    val_ids: TokenDocs  # validation documents (routing report, path early stopping)
    val_labels: list[Optional[str]]
    eval_ids: TokenDocs  # what the final evaluation scores: trainer.eval_split
    router: Any
    report: dict
    warmup_steps: int = 0
    train_dataset: Any = None  # the rows write_shards copies when re-sharding (== train_ids)
    train_labels: Optional[np.ndarray] = None  # label code of each training document (None: unlabelled data)
    timings: dict[str, float] = field(default_factory=dict)
    warmup_intervals: list[dict] = field(default_factory=list)  # the warm-up's curve, when it trained now


def _log(msg: str) -> None:
    log.info(msg)  # the "dipaco" logger: the console and the run's train.log


def _evaluated(cfg: Config, val_ids: TokenDocs) -> TokenDocs:
    """The documents of the split that the run's evaluation scores (:func:`evaluated_rows`)."""
    return val_ids.select(evaluated_rows(len(val_ids), cfg.trainer.eval_max_documents))


def validation_ids(cfg: Config, run: RunDir, split: Optional[str] = None) -> TokenDocs:
    """A finished run's evaluated documents (``trainer.eval_split``) as token ids, exactly
    as its evaluation saw them (same corpus split, the run's tokenizer and token cache).
    ``split``: the documents its evaluation would have scored on that split instead.
    The corpus is loaded into a temporary store outside the run directory."""
    run.require(run.tokenizer, "tokenizer")
    cache = cfg.data.cache_dir or str(run.cache)
    name = split or cfg.trainer.eval_split
    own = recorded_split(run, cache, name)  # the run's own copy, as it recorded it: no corpus read
    if own is not None:
        return _evaluated(cfg, own)
    load = load_token_corpus if cfg.data.source == "tokens" else load_corpus
    with load(cfg.data, progress=False) as corpus:
        data_fp = dataset_content_hash(corpus.split("train")) + ":" + dataset_content_hash(corpus.split("validation"))
        check_corpus(run, data_fp, f"data.path={cfg.data.path}" if cfg.data.path else f"data.source={cfg.data.source}")
        ids = split_tokens(corpus, name, Tokenizer.load(run.tokenizer), _readable_cache(cache), False)
    return _evaluated(cfg, ids)


def _readable_cache(cache: str) -> str:
    """The token cache a read of a finished run uses: the run's own, or where that cannot be
    written (a run on a read-only share) a temporary folder removed at exit, so that
    scoring a run never needs to write into it."""
    if writable_problem(resolved(cache), folder=True) is None:
        return cache
    tmp = tempfile.mkdtemp(prefix="dipaco-tokens-")
    atexit.register(shutil.rmtree, tmp, True)
    return tmp


def prepare(cfg: Config, run: RunDir) -> Prepared:
    """Run (or, on resume, reload) every step before training."""
    t = cfg.trainer
    fps = Fingerprints(run, cfg, _log)
    data = prepare_tokens(cfg, run, fps, _log)
    tokenizer, train_ids, val_ids, data_fp = data.tokenizer, data.train_ids, data.val_ids, data.data_fp
    timings = data.timings

    # Dense warm-up: the paper initialises every path from a dense model.
    n_warm = warmup_steps(cfg)
    warm_grid, warm_curve = None, []
    want_warm = fps.want("warmup", data=data_fp, tokenizer=tokenizer.sha256, steps=n_warm)
    if n_warm > 0:
        t0 = time.perf_counter()
        if fps.reusable("warmup", want_warm, (run.warmup / "modules.safetensors").exists(), "warmup/"):
            warm_grid = load_dense_grid(cfg, run.warmup)
        else:
            _log(f"dense warm-up: {n_warm} steps")
            warm_grid, stats = train_dense(cfg, train_ids, tokenizer.eos_id, steps=n_warm,
                                           stream_id=WARMUP_STREAM_ID, progress_desc="warm-up",
                                           log_every=cfg.logging.every_steps)
            warm_curve = stats.intervals
            save_dense(run.warmup, warm_grid, {"steps": n_warm, "loss": stats.loss,
                                                "tokens": stats.tokens, "seconds": stats.seconds})
            fps.record("warmup", want_warm)
        timings["warmup_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    r = cfg.router
    featurizer_fn = lm_featurizer(warm_grid) if r.featurizer == "lm" else None
    want = fps.want("router", data=data_fp, tokenizer=tokenizer.sha256,
                    features=want_warm if r.featurizer == "lm" else r.featurizer)
    if fps.reusable("router", want, (run.router / "manifest.json").exists(), "router/"):
        try:
            router = Router.load(run.router, expected_grid=list(cfg.grid.levels), featurizer_fn=featurizer_fn)
        except ValueError as e:  # another grid, a corrupt array, a missing file: the user's to fix
            raise RunDirError(f"cannot reuse {run.router}: {e}") from None
    else:
        router = _fit_router(cfg, train_ids, featurizer_fn)
        router.save(run.router)
        fps.record("router", want)
        release_free_memory()  # the fit's work arrays, before the costs of every document
    router.featurizer.progress = False  # routing draws one bar over every document (assign_in_batches)
    want_shards = shards_fingerprint(fps, run)
    reuse_shards = fps.reusable("shards", want_shards, run.shards.is_dir() and run.routing_report.is_file(),
                                "shards/")
    assignments = None  # shards its fingerprints vouch for (a resume): no document is routed again
    if not reuse_shards:
        assignments = assign_in_batches(router, train_ids, progress=bars_enabled(t.progress), as_array=True)
        release_free_memory()  # the [N, P] costs and the assignment's work arrays
        with progress_bars(t.progress):
            write_shards(train_ids, expand_replicas(assignments, cfg.grid.replicas, cfg.seed),
                         router.num_paths * cfg.grid.replicas, run.shards)
        release_free_memory()
    val_shards = t.path_early_stopping or cfg.logging.val_documents
    best = None  # each validation document's best path: routed only where something needs it
    if val_shards or not reuse_shards:
        best = router.route_batch(val_ids.prefixes(r.prefix_tokens)) if len(val_ids) else np.zeros(0, np.int64)
    # each path's own validation shard (cheap and deterministic: rewritten), for early
    # stopping and the per-round validation sample (logging.val_documents)
    if val_shards:
        write_validation_shards(run, best, val_ids, router.num_paths)
    val_labels = data.val_labels
    labels = val_labels if any(lab is not None for lab in val_labels) else None
    # per-document path lists: shard sizes and imbalance are the training shards' (every
    # membership counts, as the balanced assignment caps them); NMI uses the best path.
    # Training labels are int codes (one per document, -1: none): the same partition as the
    # label strings, so the same NMI and purity, in 4 bytes a document
    train_labels = data.train_labels
    if reuse_shards:  # as written with the shards (a re-shard adds to it)
        report = run.read_json(run.routing_report)
    else:
        report = routing_report(assignments, num_paths=router.num_paths, grid=router.grid, labels=train_labels)
        report["validation"] = routing_report(best, num_paths=router.num_paths, labels=labels, grid=router.grid)
        write_json(run.routing_report, report)
        fps.record("shards", want_shards)
    want = fps.want("checkpoints", data=data_fp, tokenizer=tokenizer.sha256)
    if not fps.reusable("checkpoints", want, run.checkpoints.is_dir() and any(run.checkpoints.iterdir()),
                        "checkpoints/"):
        fps.record("checkpoints", want)
    if data.record:  # everything was accepted: a later resume may take the token splits from the record
        save_record(fps, cfg.data.cache_dir or str(run.cache), data.record, val_labels, train_labels)
    timings["route_s"] = time.perf_counter() - t0
    timings.setdefault("peak_rss_mib", {})["route"] = round(peak_rss_mib(), 1)
    nmi = ""
    if report.get("nmi") is not None:
        levels = " ".join(f"L{lv['level']} {lv['nmi']:.3f}" for lv in report.get("levels", []) if lv["modules"] > 1)
        nmi = f", NMI vs labels {report['nmi']:.3f}" + (f" (per level: {levels})" if levels else "")
    _log(f"routing: shard sizes {report['shard_sizes']}, imbalance {report['imbalance']:.2f}{nmi}")
    return Prepared(tokenizer=tokenizer, train_ids=train_ids, val_ids=val_ids, val_labels=val_labels,
                    eval_ids=data.eval_ids, router=router, report=report, warmup_steps=n_warm, warmup_intervals=warm_curve,
                    train_dataset=train_ids, train_labels=train_labels, timings=timings)


def shards_fingerprint(fps: Fingerprints, run: RunDir) -> dict:
    """What the shards on disk must have been made from: the router as saved (a
    discriminative re-shard rewrites both) and the data the router assigned."""
    return fps.want("shards", router=sha256_file(run.router / "manifest.json"),
                    data=fps.saved.get("router", {}).get("data"))


def _fit_router(cfg: Config, train_ids: TokenDocs, featurizer_fn: Optional[Callable]) -> Any:
    r = cfg.router
    n_tokens = r.cluster_tokens or r.prefix_tokens
    docs = train_ids.prefixes(n_tokens)  # views: no document is copied whole
    if len(docs) > ROUTER_FIT_MAX_DOCUMENTS:
        docs = docs.select(np.linspace(0, len(docs) - 1, ROUTER_FIT_MAX_DOCUMENTS).astype(np.int64))
    docs = docs.in_memory()  # at most ROUTER_FIT_MAX_DOCUMENTS x cluster_tokens tokens
    featurizer = None
    if featurizer_fn is not None:
        featurizer = CallableFeaturizer(featurizer_fn, dim=cfg.model.d_model)
    else:
        featurizer = TokenTfidfFeaturizer(dim=r.feature_dim, seed=cfg.seed)
    # the router's settings and its method's are router.<name> keys (dipaco/config/schema.py)
    settings = {f.name: getattr(r, f.name) for f in fields(RouterSettings)}
    method = method_config(r.method, r)
    if method.experimental:
        _log(f"routing: router.method={r.method} is experimental: {method.experimental}")
    return Router.fit(docs, list(cfg.grid.levels), method=method, seed=cfg.seed,
                      featurizer=featurizer, **dict(settings, cluster_tokens=n_tokens))
