"""``validate_config``: every key inside its domain (:mod:`dipaco.config.domains`), then the
combinations a domain cannot express.

Checked before any work (docs/design.md contract 6); every problem is one
:class:`~dipaco.config.ConfigError` naming the key and the fix. The config is all it reads:
what only torch, the machine or a file can answer (an optimiser's step, devices, FSDP2, a
tokenizer's size) is :func:`dipaco.job.preflight.preflight`'s, which runs this first.
"""
from __future__ import annotations

import importlib.util
import math

from dipaco.config import Config, ConfigError, LauncherConfig, LoggingConfig, eval_window, require
from dipaco.config.applies import check_applies
from dipaco.config.decoupled import mode_problems
from dipaco.config.domains import check_domains
from dipaco.config.names import DATA_SOURCES
from router.methods import method_class


def validate_config(cfg: Config) -> None:
    """Check combinations the schema cannot express; raise :class:`ConfigError`.

    Called before any work (tokenizer, routing, ranks), so a bad sweep point fails in
    milliseconds with the key to change.
    """
    check_domains(cfg, _DERIVED_FROM)  # named themselves, not through the keys derived from them
    resolve_derived(cfg)
    check_domains(cfg)  # every key in its range (dipaco/config/domains.py); below: what a range cannot say
    check_applies(cfg)  # every key set only where it is read (dipaco/config/applies.py)

    d, g, r, dl, t, la, m = cfg.data, cfg.grid, cfg.router, cfg.diloco, cfg.trainer, cfg.launcher, cfg.model
    require(DATA_SOURCES[d.source].kind == "builtin" or bool(d.path), "data.path",
             f"data.source={d.source} needs a path", "pass data.path=FILE (or a hub dataset name)")
    num_paths = math.prod(int(k) for k in g.levels)
    require(g.replicas == 1 or dl.mode == "sync", "grid.replicas",
             "replicas are trained by the synchronous rounds only", "use diloco.mode=sync")
    for key, problem, fix in mode_problems(dl.mode, dl.lossy_exchange, dl.outer.name, dl.decoupled):
        raise ConfigError(key, problem, fix)  # an option the chosen sync mode cannot honour
    require(not (dl.outer.nesterov and dl.outer.momentum <= 0), "diloco.outer.nesterov",
             f"diloco.outer.nesterov=true needs diloco.outer.momentum > 0 (it is {dl.outer.momentum})",
             "set diloco.outer.momentum=0.9 or diloco.outer.nesterov=false")
    _validate_streaming(cfg)
    require(r.featurizer != "lm" or t.warmup_fraction > 0, "router.featurizer",
             "LM features need the dense warm-up model", "set router.featurizer=tfidf, or trainer.warmup_fraction=0.25")
    require(r.balance != "soft" or r.soft_capacity_factor >= r.capacity_factor, "router.soft_capacity_factor",
            f"must be >= router.capacity_factor ({r.capacity_factor})",
            f"set router.soft_capacity_factor={max(2.0, r.capacity_factor)}")
    _validate_reshard(cfg)
    require(not (r.prompt_classifier and not method_class(r.method).learns_content), "router.prompt_classifier",
            f"learns content-based shards, which the {r.method} control does not have", "router.prompt_classifier=false")
    _validate_evaluation(cfg)
    # options the chosen launcher never reads were refused by check_applies
    if la.name == "slurm":
        _validate_slurm(la)
    if la.name in ("spawn", "slurm"):
        nodes = la.nodes if la.name == "slurm" else 1
        world = la.nproc * nodes
        require(world % la.group_size == 0, "launcher.nproc",
                 f"world size {world} is not a multiple of launcher.group_size={la.group_size}",
                 f"use launcher.nproc={la.group_size * max(1, la.nproc // la.group_size)}")
        trained = num_paths * g.replicas
        require(world // la.group_size <= trained, "launcher.nproc",
                 f"{world // la.group_size} worker groups for {trained} paths would leave ranks idle",
                 _idle_ranks_fix(world, trained, la, t.batch_size, nodes))
    require(t.batch_size % la.group_size == 0, "trainer.batch_size",
             f"{t.batch_size} sequences cannot be split over launcher.group_size={la.group_size} ranks",
             f"use trainer.batch_size={la.group_size * max(1, -(-t.batch_size // la.group_size))} (a multiple of "
             "the group size)")
    _validate_group_parallel(cfg)
    _validate_elastic(cfg)
    _validate_logging(cfg.logging)
    _validate_heads(m.d_model, m.n_heads)
    try:
        m.validate()
    except ValueError as e:
        raise ConfigError("model", str(e), "see the model group in conf/model/") from None


_DEFAULT_ROUNDS = Config().trainer.rounds
# What resolve_derived reads (router.top_k is derived, not read: a dense grid resets it).
_DERIVED_FROM = ("trainer.total_steps", "diloco.inner_steps", "data.documents_per_path",
                 "data.max_train_documents", "grid.levels")


def resolve_derived(cfg: Config) -> Config:
    """Fill settings derived from others (``trainer.total_steps`` → ``trainer.rounds``)."""
    t, H = cfg.trainer, cfg.diloco.inner_steps
    if t.total_steps is not None and H >= 1:  # H < 1: check_domains names diloco.inner_steps
        require(t.total_steps % H == 0 and t.total_steps >= H, "trainer.total_steps",
                f"{t.total_steps} steps are not a whole number of rounds of H={H}",
                f"use trainer.total_steps={max(H, t.total_steps // H * H)} (a multiple of diloco.inner_steps)")
        derived = t.total_steps // H
        # trainer.rounds beside trainer.total_steps would be dropped: refused unless it is the
        # schema default or already the derived value (a saved, resolved config). A resume
        # reads the total from its own saved config (dipaco/run/resume.py), so it is not asked.
        require(cfg.resume or t.rounds in (_DEFAULT_ROUNDS, derived), "trainer.rounds",
                f"trainer.rounds={t.rounds} is set beside trainer.total_steps={t.total_steps}, which makes "
                f"{derived} rounds of H={H}", f"drop trainer.total_steps (or set trainer.rounds={derived})")
        t.rounds = derived
    d = cfg.data
    if d.documents_per_path is not None:
        require(d.documents_per_path >= 1, "data.documents_per_path",
                f"must be >= 1, got {d.documents_per_path}", "e.g. data.documents_per_path=500")
        want = int(d.documents_per_path) * math.prod(cfg.grid.levels)
        # (idempotent: a config resolved before, e.g. the saved one of a resumed run, passes)
        require(d.max_train_documents in (None, want), "data.documents_per_path",
                f"set together with data.max_train_documents={d.max_train_documents}",
                "drop data.max_train_documents (or data.documents_per_path)")
        d.max_train_documents = want
    if math.prod(cfg.grid.levels) == 1 and cfg.router.top_k > 1:
        # One routed path takes every document whatever top_k says: the default top_k=2
        # must not make grid=dense or the flat-DiLoCo baseline a config error.
        cfg.router.top_k = 1
    return cfg


def _validate_streaming(cfg: Config) -> None:
    """``diloco.streaming`` (dipaco/plan/stagger.py): the synchronous rounds only, replicated
    worker groups; its options are read only when it is on."""
    dl, key = cfg.diloco, "diloco.streaming"
    if not dl.streaming:  # its options set without it: dipaco/config/applies.py
        return
    require(dl.mode == "sync", key, "decoupled mode has no rounds whose sync points could be staggered",
            "use diloco.mode=sync, or diloco.streaming=false")
    require(cfg.launcher.group_parallel != "fsdp", key, "streaming keeps a copy of each path's modules, "
            "which is not written for FSDP2-sharded modules", "use launcher.group_parallel=replicate")


def _validate_evaluation(cfg: Config) -> None:
    t, m, r = cfg.trainer, cfg.model, cfg.router
    window = eval_window(cfg)
    # rotary tables stop at max_seq_len: a window cannot be longer than the model's positions
    require(window <= m.max_seq_len, "trainer.eval_seq_len",
             f"{window} is longer than model.max_seq_len ({m.max_seq_len})",
             f"use trainer.eval_seq_len={m.max_seq_len}, or raise model.max_seq_len")
    require(window > r.prefix_tokens, "trainer.eval_seq_len",
             f"a window of {window} tokens does not reach past the routing prefix ({r.prefix_tokens})",
             f"use trainer.eval_seq_len={min(m.max_seq_len, 2 * r.prefix_tokens + 1)} (> {r.prefix_tokens})")
    require(t.eval_split == "validation" or cfg.data.test_fraction > 0, "trainer.eval_split",
             "data.test_fraction=0 leaves the test split empty", "set data.test_fraction=0.05")
    require(not t.path_early_stopping or cfg.diloco.mode == "sync", "trainer.path_early_stopping",
             "path early stopping runs in the synchronous rounds only", "use diloco.mode=sync")
    require(not t.path_early_stopping or r.reshard_at_round is None, "trainer.path_early_stopping",
             "a re-shard re-routes the validation shards the kept weights were chosen on",
             "drop router.reshard_at_round or trainer.path_early_stopping")


def _validate_reshard(cfg: Config) -> None:
    """The EM re-shard phases: ``reshard_at_round``, then every ``reshard_every`` rounds."""
    r = cfg.router
    require(r.reshard_every is None or r.reshard_at_round is not None, "router.reshard_every",
            "repeats the re-shard that router.reshard_at_round starts, which is off",
            "set router.reshard_at_round=1 (the first phase), or drop router.reshard_every")
    require(r.reshard_at_round is None or cfg.diloco.mode == "sync", "router.reshard_at_round",
            "re-sharding runs between the synchronous rounds only", "use diloco.mode=sync or drop the re-shard")


def _validate_group_parallel(cfg: Config) -> None:
    """``launcher.group_parallel=fsdp`` (dipaco/sync/fsdp.py): what it needs, what it refuses."""
    la, t, dl = cfg.launcher, cfg.trainer, cfg.diloco
    key = "launcher.group_parallel"
    if la.group_parallel != "fsdp":
        return
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
    # FSDP2 present and the parameter shapes it splits: dipaco/job/preflight.py


def _idle_ranks_fix(world: int, paths: int, la: LauncherConfig, batch_size: int, nodes: int) -> str:
    """The fix for more worker groups than paths: fewer ranks, or bigger groups when that fits
    (each a concrete override, so applying the fix is accepted)."""
    fewer = (f"use launcher.nproc={la.group_size * max(1, paths // nodes)} (at most {paths * la.group_size} ranks "
             "in all, launcher.nproc x launcher.nodes), or fewer launcher.nodes")
    g = world // paths if world % paths == 0 else None
    if g and g > la.group_size and batch_size % g == 0 and la.group_parallel == "replicate":
        return f"set launcher.group_size={g} ({paths} worker groups of {g} ranks), or {fewer}"
    return fewer


def _validate_heads(d_model: int, heads: int) -> None:
    """Heads split ``model.d_model`` into whole heads of an even width (rotary embeddings
    rotate pairs of channels); the fix is the nearest head count that does."""
    fits = [h for h in range(1, d_model + 1) if d_model % h == 0 and (d_model // h) % 2 == 0]
    if d_model % heads == 0 and (d_model // heads) % 2 == 0:
        return
    if not fits:  # an odd width has no even head
        require(False, "model.d_model", f"{d_model} is odd: no head count splits it into heads of an even width "
                "(rotary embeddings rotate pairs of channels)", f"use model.d_model={d_model + 1} model.n_heads=1")
    near = min(fits, key=lambda h: (abs(h - heads), h))
    why = (f"{heads} heads do not divide model.d_model={d_model}" if d_model % heads else
           f"{heads} heads make heads of {d_model // heads} channels of model.d_model={d_model}, an odd width (rotary "
           "embeddings rotate pairs of channels)")
    require(False, "model.n_heads", why, f"use model.n_heads={near}")


def _validate_slurm(la: LauncherConfig) -> None:
    require(bool(la.partition) or la.dry_run, "launcher.partition", "launcher=slurm needs a SLURM partition",
             "pass launcher.partition=NAME (`sinfo -s` lists them)")
    require(la.gpus_per_node is None or la.nproc <= la.gpus_per_node, "launcher.nproc",
             f"{la.nproc} ranks per node but {la.gpus_per_node} GPUs: each rank needs its own GPU",
             f"use launcher.nproc={la.gpus_per_node} (one rank per GPU)")


def _validate_logging(log: LoggingConfig) -> None:
    require(not log.wandb or importlib.util.find_spec("wandb") is not None, "logging.wandb",
             "wandb is not installed", "pip install -e \".[wandb]\" (or pip install wandb), or set logging.wandb=false")


def _validate_elastic(cfg: Config) -> None:
    """``launcher.elastic`` (dipaco/runtime/elastic_spawn.py): what it needs, what it refuses."""
    la = cfg.launcher
    if not la.elastic:  # its options set without it: dipaco/config/applies.py
        return
    require(la.name == "spawn", "launcher.elastic", f"launcher={la.name} has no elastic agents of dipaco's",
            "use launcher=spawn; under torchrun pass --nnodes=MIN:MAX --max-restarts=N (docs/launch.md)")
    require(cfg.diloco.mode == "sync", "launcher.elastic", "decoupled mode's workers hold leases, not ranks: "
            "a lost worker is already replaced there", "drop launcher.elastic (docs/decoupled.md)")
    require(cfg.router.reshard_at_round is None, "launcher.elastic",
            "an elastic launch cannot stop for the EM re-shard", "drop router.reshard_at_round")
    require((la.min_nproc or la.group_size) % la.group_size == 0, "launcher.min_nproc",
            f"{la.min_nproc} ranks are not whole worker groups of launcher.group_size={la.group_size}",
            f"use launcher.min_nproc={la.group_size} (a multiple of {la.group_size})")
