"""``validate_config``: every key inside its domain (:mod:`dipaco.domains`), then the
combinations a domain cannot express.

Checked before any work (docs/design.md contract 6); every problem is one
:class:`~dipaco.config.ConfigError` naming the key and the fix.
"""
from __future__ import annotations

import importlib.util
import math

import torch

from dipaco.config import Config, ConfigError, LauncherConfig, LoggingConfig, eval_window, require
from dipaco.data.tokenizer import Tokenizer
from dipaco.decoupled.config import mode_problems
from dipaco.device import config_problems as device_problems
from dipaco.domains import (ALPHAS, DATA_SOURCES, FEATURIZERS, GROUP_PARALLEL, LAUNCHERS, MIN_VOCAB, MODES,
                            RESHARD_ASSIGNS, ROUTER_BALANCES, ROUTER_METHODS, WANDB_MODES, check_domains)
from dipaco.sync.codecs import CODECS
from dipaco.sync.fsdp import FSDP_MISSING, fsdp_available
from dipaco.sync.outer import make_outer_optimizer, outer_options
from modules import ModuleGrid


def validate_config(cfg: Config) -> None:
    """Check combinations the schema cannot express; raise :class:`ConfigError`.

    Called before any work (tokenizer, routing, ranks), so a bad sweep point fails in
    milliseconds with the key to change.
    """
    check_domains(cfg, _DERIVED_FROM)  # named themselves, not through the keys derived from them
    resolve_derived(cfg)
    check_domains(cfg)

    d, g, r, dl, t, la, m = cfg.data, cfg.grid, cfg.router, cfg.diloco, cfg.trainer, cfg.launcher, cfg.model
    require(d.source in DATA_SOURCES, "data.source", f"unknown source {d.source!r}",
             f"use one of {', '.join(DATA_SOURCES)}")
    require(d.source in ("python_sources", "multidomain") or bool(d.path), "data.path",
             f"data.source={d.source} needs a path", "pass data.path=FILE (or a hub dataset name)")
    require(d.max_documents is None or d.max_documents > 0, "data.max_documents",
             f"must be positive, got {d.max_documents}", "pass a positive number or null")
    require(d.max_train_documents is None or d.max_train_documents > 0, "data.max_train_documents",
            f"must be positive, got {d.max_train_documents}", "pass a positive number or null")
    require(0 <= d.val_fraction < 1 and 0 <= d.test_fraction < 1
             and d.val_fraction + d.test_fraction < 1, "data.val_fraction",
             "validation + test fractions must lie in [0, 1)", "use e.g. 0.05 each")
    require(len(g.levels) > 0 and all(int(k) >= 1 for k in g.levels), "grid.levels",
             f"a grid needs at least one level and K >= 1 per level, got {list(g.levels)}",
             "pass e.g. grid.levels=[2,2]")
    num_paths = math.prod(int(k) for k in g.levels)
    require(g.replicas >= 1, "grid.replicas", f"must be >= 1, got {g.replicas}", "e.g. grid.replicas=4")
    require(g.replicas == 1 or dl.mode == "sync", "grid.replicas",
             "replicas are trained by the synchronous rounds only", "use diloco.mode=sync")
    require(dl.inner_steps > 0, "diloco.inner_steps", f"H must be > 0, got {dl.inner_steps}",
             "pass diloco.inner_steps=50 (or any positive number)")
    require(dl.mode in MODES, "diloco.mode", f"unknown mode {dl.mode!r}", f"use one of {MODES}")
    for key, problem, fix in mode_problems(dl.mode, dl.lossy_exchange, dl.outer.name, dl.decoupled):
        raise ConfigError(key, problem, fix)  # an option the chosen sync mode cannot honour
    require(dl.alpha in ALPHAS, "diloco.alpha", f"unknown weighting {dl.alpha!r}",
             f"use one of {', '.join(ALPHAS)}")
    require(dl.codec in CODECS, "diloco.codec", f"unknown codec {dl.codec!r}",
             f"use one of {', '.join(CODECS)}")
    require(dl.lossy_exchange in ("auto", "reduce_scatter", "all_gather"), "diloco.lossy_exchange",
             f"unknown exchange {dl.lossy_exchange!r}", "use auto, reduce_scatter or all_gather")
    require(dl.outer_device in ("auto", "cpu"), "diloco.outer_device",
             f"unknown place {dl.outer_device!r}", "use auto (the module's device) or cpu")
    require(not (dl.outer.nesterov and dl.outer.momentum <= 0), "diloco.outer.nesterov",
             "Nesterov needs momentum > 0", "set diloco.outer.momentum=0.9 or diloco.outer.nesterov=false")
    _validate_outer_step(cfg)
    require(r.prefix_tokens > 0, "router.prefix_tokens", "must be > 0", "e.g. 32")
    require(r.prefix_tokens < t.seq_len, "router.prefix_tokens",
             f"the routing prefix ({r.prefix_tokens}) must be shorter than trainer.seq_len ({t.seq_len})",
             "lower router.prefix_tokens or raise trainer.seq_len")
    require(r.cluster_tokens is None or r.cluster_tokens >= r.prefix_tokens, "router.cluster_tokens",
            f"must be >= router.prefix_tokens ({r.prefix_tokens}) or null",
            f"e.g. router.cluster_tokens={max(128, r.prefix_tokens)}")
    require(r.method in ROUTER_METHODS, "router.method", f"unknown method {r.method!r}",
             f"use one of {ROUTER_METHODS}")
    require(r.featurizer in FEATURIZERS, "router.featurizer", f"unknown featurizer {r.featurizer!r}",
             f"use one of {FEATURIZERS}")
    require(r.featurizer != "lm" or t.warmup_fraction > 0, "router.featurizer",
             "LM features need the dense warm-up model", "set trainer.warmup_fraction>0 or router.featurizer=tfidf")
    require(1 <= r.top_k <= num_paths, "router.top_k", f"must be in [1, {num_paths}], got {r.top_k}",
             "use router.top_k=1 (or up to the number of paths)")
    require(r.capacity_factor >= 1.0, "router.capacity_factor", "must be >= 1", "e.g. 1.25")
    require(r.balance in ROUTER_BALANCES, "router.balance", f"unknown balance {r.balance!r}",
            f"use one of {ROUTER_BALANCES}")
    require(r.balance != "soft" or r.soft_capacity_factor >= r.capacity_factor, "router.soft_capacity_factor",
            f"must be >= router.capacity_factor ({r.capacity_factor})", "e.g. 2.0")
    _validate_reshard(cfg)
    require(r.fine_clusters is None or r.fine_clusters >= num_paths, "router.fine_clusters",
            f"must be >= the number of paths ({num_paths}) or null", "router.fine_clusters=null (8 per path, at least 64)")
    require(not (r.prompt_classifier and r.method == "random"), "router.prompt_classifier",
            "learns content-based shards, which the random control does not have", "router.prompt_classifier=false")
    require(r.reroute_context is None or r.reroute_context > 0, "router.reroute_context",
            "must be positive or null (everything read so far)", "e.g. router.reroute_context=128")
    require(r.reroute_every is None or r.reroute_every > 0, "router.reroute_every",
             "must be positive or null", "e.g. router.reroute_every=64")
    require(t.rounds > 0, "trainer.rounds", f"must be > 0, got {t.rounds}", "e.g. trainer.rounds=8")
    require(t.batch_size > 0 and t.seq_len > 1, "trainer.batch_size", "batch and sequence must be positive",
             "e.g. trainer.batch_size=16 trainer.seq_len=128")
    require(t.seq_len <= m.max_seq_len, "trainer.seq_len",
             f"longer than model.max_seq_len ({m.max_seq_len})", "raise model.max_seq_len")
    _validate_evaluation(cfg)
    require(0 <= t.warmup_fraction < 1, "trainer.warmup_fraction", "must lie in [0, 1)", "e.g. 0.25")
    require(t.keep_last >= 1, "trainer.keep_last", "must keep at least one checkpoint", "e.g. 2")
    require(la.name in LAUNCHERS, "launcher", f"unknown launcher {la.name!r}", f"use one of {LAUNCHERS}")
    require(la.nproc >= 1 and la.group_size >= 1, "launcher.nproc", "must be >= 1", "e.g. launcher.nproc=4")
    # options the chosen launcher never reads are refused rather than silently ignored
    require(la.name != "local" or la.group_size == 1, "launcher.group_size",
             "launcher=local runs one process, so there is no worker group to split",
             "add launcher=spawn (ranks on this host) or drop launcher.group_size")
    require(la.name != "torchrun" or la.nproc == 1, "launcher.nproc",
             "under launcher=torchrun the number of ranks comes from torchrun", "use torchrun --nproc-per-node=N")
    require(la.name == "slurm" or not la.dry_run, "launcher.dry_run", "only launcher=slurm submits a job to "
            "preview", "add launcher=slurm, or drop launcher.dry_run (dipaco-plan previews any launcher)")
    if la.name == "slurm":
        _validate_slurm(la)
    if la.name in ("spawn", "slurm"):
        world = la.nproc * (la.nodes if la.name == "slurm" else 1)
        require(world % la.group_size == 0, "launcher.nproc",
                 f"world size {world} is not a multiple of launcher.group_size={la.group_size}",
                 f"use launcher.nproc={la.group_size * max(1, la.nproc // la.group_size)}")
        trained = num_paths * g.replicas
        require(world // la.group_size <= trained, "launcher.nproc",
                 f"{world // la.group_size} worker groups for {trained} paths would leave ranks idle",
                 f"use at most {trained * la.group_size} ranks in all (launcher.nproc x launcher.nodes)")
    require(t.batch_size % la.group_size == 0, "trainer.batch_size",
             f"{t.batch_size} sequences cannot be split over launcher.group_size={la.group_size} ranks",
             "use a batch size that is a multiple of the group size")
    for key, problem, fix in device_problems(t, la):
        raise ConfigError(key, problem, fix)
    _validate_group_parallel(cfg)
    require(m.vocab_size >= MIN_VOCAB, "model.vocab_size",
             f"{m.vocab_size} is too small: a byte-level BPE needs {MIN_VOCAB} tokens (256 bytes + end-of-text)",
             f"use model.vocab_size={MIN_VOCAB} or more (tiny uses 512)")
    _validate_logging(cfg.logging)
    try:
        m.validate()
    except ValueError as e:
        raise ConfigError("model", str(e), "see the model group in conf/model/") from None
    if d.tokenizer:
        size = Tokenizer.load(d.tokenizer).vocab_size
        require(m.vocab_size >= size, "model.vocab_size",
                 f"{m.vocab_size} cannot hold the {size} token ids of data.tokenizer={d.tokenizer}",
                 f"set model.vocab_size={size} (or leave it out: the CLIs set it from data.tokenizer)")


# What resolve_derived reads (router.top_k is derived, not read: a dense grid resets it).
_DERIVED_FROM = ("trainer.total_steps", "diloco.inner_steps", "data.documents_per_path",
                 "data.max_train_documents", "grid.levels")


def resolve_derived(cfg: Config) -> Config:
    """Fill settings derived from others (``trainer.total_steps`` → ``trainer.rounds``)."""
    t, H = cfg.trainer, cfg.diloco.inner_steps
    if t.total_steps is not None and H >= 1:  # H < 1: check_domains names diloco.inner_steps
        require(t.total_steps % H == 0 and t.total_steps >= H, "trainer.total_steps",
                f"{t.total_steps} steps are not a whole number of rounds of H={H}",
                "use a multiple of diloco.inner_steps")
        t.rounds = t.total_steps // H
    d = cfg.data
    if d.documents_per_path is not None:
        require(d.documents_per_path >= 1, "data.documents_per_path",
                f"must be >= 1, got {d.documents_per_path}", "e.g. data.documents_per_path=500")
        want = int(d.documents_per_path) * math.prod(cfg.grid.levels)
        # (idempotent: a config resolved before, e.g. the saved one of a resumed run, passes)
        require(d.max_train_documents in (None, want), "data.documents_per_path",
                f"set together with data.max_train_documents={d.max_train_documents}", "drop one of the two")
        d.max_train_documents = want
    if math.prod(cfg.grid.levels) == 1 and cfg.router.top_k > 1:
        # One routed path takes every document whatever top_k says: the default top_k=2
        # must not make grid=dense or the flat-DiLoCo baseline a config error.
        cfg.router.top_k = 1
    return cfg


def _validate_outer_step(cfg: Config) -> None:
    """Build the outer optimiser and take one step on a one-element tensor: an optimiser
    that needs a closure (LBFGS) or sparse gradients (SparseAdam) would otherwise fail
    only after the first round's compute."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    try:
        make_outer_optimizer([p], **outer_options(cfg.diloco)).step()
    except Exception as e:  # noqa: BLE001 - any failure of the optimiser is the config's
        first = " ".join(str(e).split())[:200]
        raise ConfigError("diloco.outer.name", f"torch.optim cannot take an outer step with "
                          f"diloco.outer={cfg.diloco.outer.name!r}: {first}",
                          "use diloco.outer.name=sgd (or adam, adamw, nadam, rmsprop)") from None
    if not torch.isfinite(p).all():
        raise ConfigError("diloco.outer", f"one outer step of {cfg.diloco.outer.name} on a unit "
                          "pseudo-gradient gives a non-finite weight", "lower diloco.outer.lr")


def _validate_evaluation(cfg: Config) -> None:
    t, m, r = cfg.trainer, cfg.model, cfg.router
    window = eval_window(cfg)
    # rotary tables stop at max_seq_len: a window cannot be longer than the model's positions
    require(window <= m.max_seq_len, "trainer.eval_seq_len",
             f"{window} is longer than model.max_seq_len ({m.max_seq_len})",
             f"use trainer.eval_seq_len<={m.max_seq_len} or raise model.max_seq_len (and trainer.seq_len)")
    require(window > r.prefix_tokens, "trainer.eval_seq_len",
             f"a window of {window} tokens does not reach past the routing prefix ({r.prefix_tokens})",
             f"use trainer.eval_seq_len>{r.prefix_tokens}")
    require(t.eval_split in ("validation", "test"), "trainer.eval_split",
             f"unknown split {t.eval_split!r}", "use trainer.eval_split=validation or test")
    require(t.eval_split == "validation" or cfg.data.test_fraction > 0, "trainer.eval_split",
             "data.test_fraction=0 leaves the test split empty", "set data.test_fraction>0, e.g. 0.05")
    require(t.eval_every >= 1, "trainer.eval_every", f"must be >= 1, got {t.eval_every}", "e.g. trainer.eval_every=2")
    require(not t.path_early_stopping or cfg.diloco.mode == "sync", "trainer.path_early_stopping",
             "path early stopping runs in the synchronous rounds only", "use diloco.mode=sync")
    require(not t.path_early_stopping or r.reshard_at_round is None, "trainer.path_early_stopping",
             "a re-shard re-routes the validation shards the kept weights were chosen on",
             "drop router.reshard_at_round or trainer.path_early_stopping")


def _validate_reshard(cfg: Config) -> None:
    """The EM re-shard phases: ``reshard_at_round``, then every ``reshard_every`` rounds."""
    r, t = cfg.router, cfg.trainer
    require(r.reshard_at_round is None or 0 < r.reshard_at_round < t.rounds, "router.reshard_at_round",
            f"must lie strictly between 0 and trainer.rounds={t.rounds}", "e.g. router.reshard_at_round=2")
    require(r.reshard_every is None or r.reshard_every >= 1, "router.reshard_every",
            f"must be >= 1 or null, got {r.reshard_every}", "e.g. router.reshard_every=4")
    require(r.reshard_every is None or r.reshard_at_round is not None, "router.reshard_every",
            "repeats the re-shard that router.reshard_at_round starts, which is off",
            "set router.reshard_at_round=K (the first phase) or drop router.reshard_every")
    require(r.reshard_assign in RESHARD_ASSIGNS, "router.reshard_assign", f"unknown value {r.reshard_assign!r}",
            f"use one of {RESHARD_ASSIGNS}")
    require(r.reshard_documents >= 1, "router.reshard_documents", f"must be >= 1, got {r.reshard_documents}",
            "e.g. router.reshard_documents=2000")
    require(r.reshard_at_round is None or cfg.diloco.mode == "sync", "router.reshard_at_round",
            "re-sharding runs between the synchronous rounds only", "use diloco.mode=sync or drop the re-shard")


def _validate_group_parallel(cfg: Config) -> None:
    """``launcher.group_parallel=fsdp`` (dipaco/sync/fsdp.py): what it needs, what it refuses."""
    la, t, dl = cfg.launcher, cfg.trainer, cfg.diloco
    key = "launcher.group_parallel"
    require(la.group_parallel in GROUP_PARALLEL, key, f"unknown value {la.group_parallel!r}",
            f"use one of {GROUP_PARALLEL}")
    if la.group_parallel != "fsdp":
        return
    require(fsdp_available(), key, FSDP_MISSING, "or use launcher.group_parallel=replicate")
    require(la.name != "local", key, "launcher=local runs one process: there is no worker group to shard over",
            "add launcher=spawn launcher.group_size=2 (or more)")
    require(la.group_size > 1, key, "with launcher.group_size=1 there is nothing to shard",
            "set launcher.group_size to 2 or more, or use launcher.group_parallel=replicate")
    require(not cfg.model.tie_embeddings, key, "model.tie_embeddings=true uses the sharded embed weight "
            "outside the embed's forward", "set model.tie_embeddings=false or launcher.group_parallel=replicate")
    require(dl.codec == "none", key, f"diloco.codec={dl.codec} is not supported on sharded modules",
            "use diloco.codec=none or launcher.group_parallel=replicate")
    require(dl.mode == "sync", key, f"diloco.mode={dl.mode} is not supported with fsdp",
            "use diloco.mode=sync or launcher.group_parallel=replicate")
    require(t.precision != "fp16", key, "fp16's loss scaler is not wired for sharded gradients",
            "use trainer.precision=bf16 (or fp32)")
    require(t.compile is not True, key, "torch.compile is not tested with fsdp", "set trainer.compile=false")
    require(not t.path_early_stopping, key, "path early stopping evaluates on one rank of the group, "
            "but sharded modules need every rank", "set trainer.path_early_stopping=false")
    grid = ModuleGrid(cfg.model, list(cfg.grid.levels))  # lazy: shapes only, on meta
    for mid in dict.fromkeys(grid.kind_of(m) if m in ("embed", "head") else "L0.0" for m in grid.module_ids):
        bad = [f"{n}{tuple(s)}" for n, s in grid.param_shapes(mid).items() if not s or s[0] % la.group_size]
        require(not bad, "launcher.group_size", f"fsdp needs every parameter's first dimension to divide by "
                f"{la.group_size}; {mid} has {', '.join(bad)}", "pick a group size that divides model.d_model, "
                "model.vocab_size and the MLP width")


def _validate_slurm(la: LauncherConfig) -> None:
    require(bool(la.partition) or la.dry_run, "launcher.partition", "launcher=slurm needs a SLURM partition",
             "pass launcher.partition=NAME (`sinfo -s` lists them)")
    require(la.cpus_per_task is None or la.cpus_per_task >= 1, "launcher.cpus_per_task",
            f"must be >= 1, got {la.cpus_per_task}", "e.g. launcher.cpus_per_task=8 (torch threads per rank)")
    require(la.max_requeues >= 0, "launcher.max_requeues", f"must be >= 0, got {la.max_requeues}",
            "e.g. launcher.max_requeues=3 (0: never requeue)")
    require(la.nodes >= 1, "launcher.nodes", f"must be >= 1, got {la.nodes}", "e.g. launcher.nodes=2")
    require(la.gpus_per_node is None or la.nproc <= la.gpus_per_node, "launcher.nproc",
             f"{la.nproc} ranks per node but {la.gpus_per_node} GPUs: each rank needs its own GPU",
             f"use launcher.nproc={la.gpus_per_node} (one rank per GPU)")


def _validate_logging(log: LoggingConfig) -> None:
    require(log.wandb_mode in WANDB_MODES, "logging.wandb_mode", f"unknown mode {log.wandb_mode!r}",
             f"use one of {', '.join(WANDB_MODES)}")
    require(not log.wandb or importlib.util.find_spec("wandb") is not None, "logging.wandb",
             "wandb is not installed", "pip install wandb, or set logging.wandb=false")
