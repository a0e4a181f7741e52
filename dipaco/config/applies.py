"""Where every setting applies, in one table keyed by dotted name (next to the domains of
:mod:`dipaco.config.domains`).

A setting is used or refused, never ignored: a key set away from its schema default where
the run would never read it (``launcher.nodes`` under ``launcher=spawn``,
``data.streaming`` with ``data=jsonl``, ``data.hub_config`` on a local folder) is refused
by :func:`check_applies` in one line naming the key, the settings it applies in and the
fix. Every key is declared, one way or the other: a key read in every setting is named in
:data:`EVERYWHERE` (``None`` in :data:`APPLIES`), every other key has its :class:`Where`;
nothing is filled in for a key that declares neither, so ``tests/test_config_applies.py``
fails for a schema key without an entry and, for every conditional entry, sets the key
where it does not apply (refused, naming it) and where it does (not refused for that
reason). The cluster keys' rows come from :data:`dipaco.config.cluster.CLUSTER_APPLIES`,
and what the simulator would reshape (idle chips, more slow groups than groups) is
refused by :func:`check_simulated`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from dipaco.config.cluster import CLUSTER_APPLIES, cluster_problems
from dipaco.config.decoupled import DecoupledConfig
from dipaco.config.domains import DOMAINS, value_of
from dipaco.config.errors import ConfigError
from dipaco.config.names import CODECS, DATA_SOURCES, SourceEntry
from dipaco.config.schema import Config
from router.methods import METHODS, method_class, method_settings

__all__ = ["APPLIES", "EVERYWHERE", "Where", "check_applies", "check_not_simulated", "check_simulated",
           "not_applying", "undeclared", "CONDITIONAL"]


@dataclass(frozen=True)
class Where:
    """The settings in which a key is read: ``when(cfg)``, said as ``says`` (``under
    launcher=slurm``), and the override that makes it apply (``fix``)."""

    when: Callable[[Config], bool]
    says: str
    fix: str


def _source(c: Config) -> SourceEntry:
    """``data.source``'s registry line (an unknown name was refused by its domain)."""
    return DATA_SOURCES.get(c.data.source, SourceEntry("unknown"))


def _builtin(c: Config) -> bool:
    return _source(c).kind == "builtin"


def _local_path(c: Config) -> bool:
    """``data.path`` names something on this host (not a hub dataset name)."""
    p = c.data.path
    return bool(p) and (os.path.exists(os.path.expanduser(p)) or "*" in p)


def _saved_dataset(c: Config) -> bool:
    """``data.path`` is a ``save_to_disk`` folder: ``load_from_disk`` reads it, which has
    no configs, splits to pick or streaming (dipaco/data/readers.py: is_saved_dataset)."""
    p = os.path.expanduser(c.data.path or "")
    return os.path.isfile(os.path.join(p, "dataset_dict.json")) or (
        os.path.isfile(os.path.join(p, "state.json")) and os.path.isfile(os.path.join(p, "dataset_info.json")))


def _load_dataset(c: Config) -> bool:
    """``datasets.load_dataset`` reads ``data.path`` (dipaco/data/corpus.py, pretokenized.py)."""
    if c.data.source == "hub":
        return not _saved_dataset(c)
    return c.data.source == "tokens" and not _local_path(c)


_HUB = Where(lambda c: c.data.source == "hub" or (c.data.source == "tokens" and not _local_path(c)),
             "with data=hub (or data=tokens naming a hub dataset)", "use data=hub")
_HUB_LOAD = Where(_load_dataset, "when data.path is a hub dataset name or a folder of data files read by "
                  "load_dataset (not with local files or a save_to_disk folder)", "use data=hub with a dataset name")
_HUB_NAME = Where(lambda c: _load_dataset(c) and not _local_path(c), "when data.path is a hub dataset name "
                  "(a local folder has no named configs)", "use data=hub with a dataset name")
_FILES = Where(lambda c: not _builtin(c), "with a file or hub source (the built-in corpora have their own "
               "fields)", "use data=jsonl (or json, parquet, hub)")
_FIELDS = Where(lambda c: not _builtin(c) and not _source(c).whole_file, "with a source of records (data=text is "
                "one document per file, python_sources/multidomain have their own fields)", "use data=jsonl")
_BUILTIN = Where(_builtin, "with data=python_sources or data=multidomain", "use data=multidomain")
_MULTIDOMAIN = Where(lambda c: c.data.source == "multidomain", "with data=multidomain", "use data=multidomain")
_SLURM = Where(lambda c: c.launcher.name == "slurm", "under launcher=slurm", "add launcher=slurm")
_RANKS = Where(lambda c: c.launcher.name != "local", "under launcher=spawn, torchrun or slurm (launcher=local "
               "runs one process, with no collectives)", "add launcher=spawn")
_NPROC = Where(lambda c: c.launcher.name != "torchrun", "under launcher=local (the simulated worker groups), "
               "spawn or slurm; under torchrun the number of ranks comes from torchrun: --nproc-per-node=N",
               "add launcher=spawn")
_GROUPS = Where(lambda c: c.launcher.name != "local", "with more than one process (launcher=local runs one, so "
                "there is no worker group to split)", "add launcher=spawn")
_ELASTIC = Where(lambda c: c.launcher.elastic, "in an elastic launch", "add launcher.elastic=true")
_STREAMING = Where(lambda c: c.diloco.streaming, "by streaming sync (diloco.streaming=true)",
                   "set diloco.streaming=true")
_WANDB = Where(lambda c: c.logging.wandb, "with logging.wandb=true", "set logging.wandb=true")
_LOSSY = Where(lambda c: CODECS.get(str(c.diloco.codec).lower(), CODECS["none"]).lossy,
               "with a lossy codec (diloco.codec other than none: codec none sends exact values)",
               "set diloco.codec=int8")
_CONTENT = Where(lambda c: method_class(c.router.method).learns_content if c.router.method in METHODS else True,
                 "by a routing method that reads the documents' features (router.method=random does not)",
                 "set router.method=product")
_RESHARD = Where(lambda c: c.router.reshard_at_round is not None, "by the EM re-shard (router.reshard_at_round)",
                 "set router.reshard_at_round=1 (the round after which it re-shards)")
_SOFT = Where(lambda c: c.router.balance == "soft", "with router.balance=soft", "set router.balance=soft")
def _codec_option(key: str) -> Where:
    """Where a codec option (``diloco.codec_block``) is read: by the codecs whose registry
    line (``dipaco.config.names.CODECS``) names it."""
    def owners() -> list[str]:
        return [n for n, c in CODECS.items() if key in c.options.values()]

    now = owners()
    names = now[0] if len(now) == 1 else f"{', '.join(now[:-1])} or {now[-1]}"
    return Where(lambda c: str(c.diloco.codec).lower() in owners(), f"by diloco.codec={names}",
                 f"set diloco.codec={now[0]}")


_COMPILE = Where(lambda c: c.trainer.compile is not False, "when torch.compile is on (trainer.compile is not "
                 "false)", "set trainer.compile=true")
_EARLY = Where(lambda c: c.trainer.path_early_stopping, "by path early stopping", "set trainer.path_early_stopping=true")
_NO_TOKENIZER = Where(lambda c: not c.data.tokenizer, "when a BPE is trained (data.tokenizer is null)",
                      "set data.tokenizer=null (train a BPE)")
_DRY_RUN = Where(lambda c: c.launcher.name == "slurm", "under launcher=slurm (only a SLURM job has a script to "
                 "preview; dipaco-plan previews any launcher)", "add launcher=slurm")


def _delayed(c: Config) -> bool:
    return str(c.diloco.outer.name).lower() == "delayed_nesterov"


def _decoupled(name: str) -> Where:
    if name in ("momentum_every", "momentum_scale"):  # the delayed Nesterov outer optimiser's N and c, in both modes
        return Where(lambda c: c.diloco.mode == "decoupled" or _delayed(c), "in decoupled mode or with "
                     "diloco.outer.name=delayed_nesterov", "set diloco.mode=decoupled")
    return Where(lambda c: c.diloco.mode == "decoupled", "in decoupled mode", "set diloco.mode=decoupled")


def _method(name: str) -> Optional[Where]:
    """A routing method's setting applies with the methods that declare it."""
    owners = [m for m in METHODS if name in {f.name for f in fields(method_class(m))}]
    if len(owners) == len(METHODS):
        return None
    return Where(lambda c: c.router.method in owners, f"with router.method={' or '.join(owners)}",
                 f"set router.method={owners[0]}")


# The keys read in every setting (by every mode, launcher and source that can be chosen).
EVERYWHERE = (
    "seed", "resume", "run_dir", "tag",
    "data.source", "data.cache_dir", "data.tokenizer", "data.max_documents", "data.max_train_documents",
    "data.documents_per_path", "data.max_doc_chars", "data.min_doc_chars", "data.val_fraction",
    "data.test_fraction", "data.splits",
    "model.vocab_size", "model.d_model", "model.n_heads", "model.layers_per_level", "model.max_seq_len",
    "model.mlp_hidden", "model.rope_theta", "model.norm_eps", "model.tie_embeddings", "model.init_std",
    "grid.levels", "grid.private_embed", "grid.private_head", "grid.replicas",
    "router.method", "router.prefix_tokens", "router.cluster_tokens", "router.reroute_context",
    "router.reroute_every", "router.prompt_classifier", "router.top_k", "router.capacity_factor",
    "router.balance", "router.reshard_at_round",
    "diloco.inner_steps", "diloco.mode", "diloco.outer.name", "diloco.outer.lr", "diloco.codec",
    "diloco.sharing_rescale", "diloco.alpha", "diloco.outer_device", "diloco.streaming",
    # diloco.outer.momentum and .nesterov: read by the optimisers that take them, which only
    # torch can say (dipaco/job/preflight.py refuses them for another optimiser)
    "diloco.outer.momentum", "diloco.outer.nesterov",
    "trainer.rounds", "trainer.total_steps", "trainer.extend_schedule", "trainer.lr_segments", "trainer.batch_size",
    "trainer.seq_len", "trainer.lr", "trainer.min_lr_ratio", "trainer.warmup_steps", "trainer.weight_decay",
    "trainer.beta1", "trainer.beta2", "trainer.grad_clip", "trainer.warmup_fraction", "trainer.dense_baseline",
    "trainer.eval_max_documents", "trainer.eval_split", "trainer.eval_batch_size", "trainer.eval_long",
    # the long protocol's window: also dipaco-infer score --long's default, so set without eval_long too
    "trainer.eval_seq_len",
    "trainer.path_early_stopping", "trainer.checkpoint_every", "trainer.keep_last", "trainer.stop_after_rounds",
    "trainer.threads", "trainer.device", "trainer.precision", "trainer.compile", "trainer.activation_checkpointing",
    "trainer.micro_batches", "trainer.deterministic", "trainer.plots", "trainer.progress",
    "launcher.name", "launcher.group_parallel", "launcher.elastic",
    "logging.tensorboard", "logging.wandb", "logging.every_steps", "logging.val_documents", "logging.peak_tflops",
    # every cluster.* key is read by dipaco-plan --simulate alone (check_not_simulated); these in every simulation
    "cluster.chips", "cluster.chips_per_group", "cluster.step_s", "cluster.mtbf_hours", "cluster.link_gbps",
    "cluster.link_scope", "cluster.latency_s", "cluster.straggler", "cluster.horizon_hours",
)
CONDITIONAL: dict[str, Where] = {
    "data.path": _FILES, "data.hub_config": _HUB_NAME, "data.hub_split": _HUB, "data.streaming": _HUB_LOAD,
    "data.text_field": _FIELDS, "data.label_field": _FILES, "data.id_field": _FIELDS, "data.group_field": _FIELDS,
    "data.exclude_packages": _BUILTIN, "data.target_doc_chars": _BUILTIN, "data.domain_max_chars": _MULTIDOMAIN,
    "data.packages": _MULTIDOMAIN,
    "data.tokenizer_sample_bytes": _NO_TOKENIZER, "data.tokenizer_sample_documents": _NO_TOKENIZER,
    "router.soft_capacity_factor": _SOFT, "router.reshard_documents": _RESHARD, "router.reshard_assign": _RESHARD,
    "router.reshard_every": _RESHARD,
    **{f"diloco.{k}": _codec_option(k) for k in sorted({k for c in CODECS.values() for k in c.options.values()})},
    **{f"diloco.{n}": _STREAMING for n in ("streaming_delay", "streaming_mix", "streaming_fragments",
                                           "streaming_spread")},
    **{f"diloco.decoupled.{f.name}": _decoupled(f.name) for f in fields(DecoupledConfig)},
    "trainer.compile_backend": _COMPILE, "trainer.eval_every": _EARLY,
    "launcher.nproc": _NPROC, "launcher.group_size": _GROUPS, "launcher.backend": _RANKS, "launcher.timeout_s": _RANKS,
    "launcher.dry_run": _DRY_RUN, "launcher.min_nproc": _ELASTIC, "launcher.rejoin_after_s": _ELASTIC,
    "launcher.max_restarts": _ELASTIC,
    **{f"launcher.{n}": _SLURM for n in ("partition", "nodes", "gpus_per_node", "cpus_per_task", "max_requeues",
                                         "mem_gb", "timeout_min", "account", "qos", "constraint", "master_port")},
    "logging.wandb_project": _WANDB, "logging.wandb_entity": _WANDB, "logging.wandb_mode": _WANDB,
    "logging.run_name": _WANDB, "logging.wandb_group": _WANDB, "logging.tags": _WANDB,  # the W&B run's, only
    "diloco.error_feedback": _LOSSY, "diloco.lossy_exchange": _LOSSY,
    "router.featurizer": _CONTENT, "router.feature_dim": _CONTENT,
    **{f"router.{n}": _method(n) for n in method_settings()},
    **{key: Where(lambda c, w=when: w(c.cluster), says, fix) for key, (when, says, fix) in CLUSTER_APPLIES.items()},
}
APPLIES: dict[str, Optional[Where]] = {**{key: None for key in EVERYWHERE}, **CONDITIONAL}


def undeclared() -> list[str]:
    """Keys of the domains table (every schema key) that declare no applies-rule, or two."""
    return sorted((set(DOMAINS) - set(APPLIES)) | (set(EVERYWHERE) & set(CONDITIONAL)))

_DEFAULTS = Config()


def _show(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def not_applying(cfg: Config) -> list[tuple[str, str, str]]:
    """Every key set away from its schema default where ``cfg`` never reads it, as
    ``(key, problem, fix)`` in table order."""
    out = []
    for key, where in APPLIES.items():
        value = value_of(cfg, key)
        if where is None or value == value_of(_DEFAULTS, key) or where.when(cfg):
            continue
        out.append((key, f"{key}={_show(value)} is read only {where.says}, so this run would ignore it",
                    f"{where.fix}, or drop {key} (its default is {_show(value_of(_DEFAULTS, key))})"))
    return out


def check_applies(cfg: Config) -> None:
    """Raise :class:`ConfigError` for the first key set where it does not apply."""
    for key, problem, fix in not_applying(cfg):
        raise ConfigError(key, problem, fix)


def check_not_simulated(cfg: Config) -> None:
    """Refuse a ``cluster.*`` key set away from its default by a command that does not
    simulate: only ``dipaco-plan --simulate`` reads the cluster description, so a training,
    routing or plain planning run would ignore it (the rule of this module)."""
    for f in fields(type(cfg.cluster)):
        key = f"cluster.{f.name}"
        value, default = value_of(cfg, key), value_of(_DEFAULTS, key)
        if value != default:
            raise ConfigError(key, f"{key}={_show(value)} describes a cluster for the simulator, which only "
                                   "dipaco-plan --simulate reads, so this command would ignore it",
                              f"run dipaco-plan --simulate with it, or drop {key} (its default is {_show(default)})")


def check_simulated(cfg: Config) -> None:
    """Refuse a cluster the simulator would reshape rather than simulate as described
    (:func:`dipaco.config.cluster.cluster_problems`: idle chips, more slow groups or
    regions than worker groups, a straggler spread of 0), naming the key."""
    paths = math.prod(int(k) for k in cfg.grid.levels) * cfg.grid.replicas
    for key, problem, fix in cluster_problems(cfg.cluster, paths):
        raise ConfigError(key, problem, fix)
