"""The domain of every setting of the config schema, in one table keyed by dotted name.

A value outside its domain is refused by :func:`check_domains` before any work (the
first step of ``validate_config``, docs/design.md contract 6), in one line naming the
key, the value, the domain and the schema default as the fix. Adding a key to the schema
means adding its domain here: ``tests/test_config_domains.py`` fails for a schema key
without one (and for a domain whose key the schema lacks), and walks every domain with
out-of-domain and edge values.

A domain says the kind (integer, real, one of some names, flag, list of integers, free
text, path), the range (``lo``/``hi``: a number, another key's dotted name, or a
function of the config), whether ``null`` is allowed, and an upper bound wherever a
larger value would exhaust memory or time (``why`` says which). Relations the table
cannot say (one key's choice forbidding another's) stay in :mod:`dipaco.config.validate`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from dipaco.config import Config, ConfigError
from dipaco.config.cluster import CLUSTER_DOMAINS
from dipaco.config.names import BACKENDS, CODECS, DATA_SOURCES, DEVICES, PRECISIONS
from router.methods import METHODS as ROUTER_METHODS, Setting, method_settings

LAUNCHERS = ("local", "spawn", "torchrun", "slurm")
GROUP_PARALLEL = ("replicate", "fsdp")  # launcher.group_parallel
ROUTER_BALANCES = ("hard", "soft")
RESHARD_ASSIGNS = ("classifier", "loss")  # router.em.RESHARD_ASSIGNS
FEATURIZERS = ("tfidf", "lm")
MODES = ("sync", "decoupled")
ALPHAS = ("tokens", "shard_size")  # what weighs a path's pseudo-gradient (dipaco/sync/alpha.py)
MIN_VOCAB = 257  # 256 byte tokens + <|endoftext|> (dipaco/data/tokenizer.py)
WANDB_MODES = ("online", "offline", "disabled")
EXTEND_SCHEDULES = ("continue", "restart")  # trainer.extend_schedule (dipaco/config/schedule.py)
# Every path is a model that is planned, initialised and (in the local backend) held in
# one process: 4,096 paths (a 64 x 64 grid) plan in seconds; the paper's grid is 16 x 16.
MAX_PATHS = 4096

Bound = Union[None, float, str, Callable[[Config], float]]
# float32's smallest normal number: a real setting reaches float32 tensors (learning rates,
# epsilons, shares) and products of times and rates, where a smaller non-zero value is 0 or
# a subnormal that overflows once divided by (5e-324 Gbit/s made a transfer of inf seconds).
# Every real domain refuses a non-zero value below it; 0 is said as 0 where 0 is allowed.
TINY = 2.0 ** -126
_BIG = 10**9  # counts of documents, steps or characters beyond any run this code can finish


@dataclass(frozen=True)
class Domain:
    """What values one setting may take (see the module docstring)."""

    kind: str  # int | real | choice | flag | ints (a list of integers) | texts | text | path
    lo: Bound = None
    hi: Bound = None
    lo_open: bool = False
    null: bool = False
    choices: Union[tuple, Callable[[], Iterable[str]], None] = None
    why: str = ""  # why the upper bound or the relation holds
    items: tuple[int, int] = (0, 0)  # ints: how many entries, at least and at most
    max_product: int = 0  # ints: bound on the product of the entries
    rising: bool = False  # ints: pairs [start, end, start, end, ...], each start < its end <= the next start

    def names(self) -> tuple[str, ...]:
        """The allowed names of a ``choice`` domain."""
        c = self.choices
        return tuple(c() if callable(c) else (c or ()))


def Int(lo: Bound, hi: Bound, null: bool = False, why: str = "") -> Domain:
    """Integers in ``[lo, hi]`` (``null`` allowed or not)."""
    return Domain("int", lo, hi, null=null, why=why)


def Real(lo: Bound, hi: Bound, lo_open: bool = False, null: bool = False, why: str = "") -> Domain:
    """Finite numbers in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    return Domain("real", lo, hi, lo_open=lo_open, null=null, why=why)


def OneOf(choices: Union[tuple, Callable[[], Iterable[str]]], null: bool = False) -> Domain:
    """One of fixed names (or of the names a function lists: a registry's, read when checked)."""
    return Domain("choice", choices=choices, null=null)


FLAG, MAYBE_FLAG = Domain("flag"), Domain("flag", null=True)
TEXT, MAYBE_TEXT = Domain("text"), Domain("text", null=True)  # free-form: a name, a field, a tag
PATH = Domain("path", null=True)  # a file or directory; written ones also pass dipaco/run/path_guard.py
COSTLY = "a larger value exhausts memory or time"


class Rel:
    """A bound computed from the config, what it is (``the number of paths``) and the keys
    it reads (checked before the key it bounds)."""

    def __init__(self, fn: Callable[[Config], float], what: str, keys: tuple[str, ...]) -> None:
        self.fn, self.what, self.keys = fn, what, keys

    def __call__(self, cfg: Config) -> float:
        return self.fn(cfg)


_paths = Rel(lambda c: math.prod(int(k) for k in c.grid.levels) if c.grid.levels else 1, "the number of paths",
           ("grid.levels",))


DOMAINS: dict[str, Domain] = {
    "seed": Int(0, 2**32 - 1, why="numpy seeds are 32-bit"),
    "data.source": OneOf(lambda: tuple(DATA_SOURCES)), "data.path": PATH, "data.hub_config": MAYBE_TEXT,
    "data.hub_split": TEXT, "data.streaming": FLAG, "data.text_field": TEXT, "data.label_field": MAYBE_TEXT,
    "data.id_field": MAYBE_TEXT, "data.group_field": MAYBE_TEXT,
    "data.max_documents": Int(1, _BIG, null=True), "data.max_train_documents": Int(1, _BIG, null=True),
    "data.documents_per_path": Int(1, Rel(lambda c: _BIG // _paths(c), "1e9 / the number of paths", ("grid.levels",)),
                                   null=True, why="x the paths it makes data.max_train_documents, at most 1e9"), "data.exclude_packages": Domain("texts"),
    "data.domain_max_chars": Int(1, 10**11, why=COSTLY), "data.packages": Domain("texts"),
    "data.target_doc_chars": Int("data.min_doc_chars", "data.max_doc_chars",
                                 why="chunks are cut between the shortest and the longest document kept"),
    "data.max_doc_chars": Int(1, 10**8, why=COSTLY), "data.min_doc_chars": Int(0, "data.max_doc_chars"),
    "data.val_fraction": Real(0, 0.5, lo_open=True, why="the validation split scores the run"),
    "data.test_fraction": Real(0, 0.5), "data.cache_dir": PATH,
    "data.splits": OneOf(("auto", "hash")),  # dipaco.data.corpus.SPLIT_MODES (config imports no data reader)
    "data.tokenizer_sample_bytes": Int(1, 10**12, null=True), "data.tokenizer_sample_documents": Int(1, _BIG, null=True), "data.tokenizer": PATH,
    "model.vocab_size": Int(MIN_VOCAB, 2**20, why=f"a byte-level BPE needs {MIN_VOCAB}; " + COSTLY),
    "model.d_model": Int(2, 16384, why=COSTLY), "model.n_heads": Int(1, "model.d_model"),
    "model.layers_per_level": Int(1, 512, why=COSTLY), "model.max_seq_len": Int(2, 2**17, why=COSTLY),
    "model.mlp_hidden": Int(1, 2**17, null=True, why=COSTLY), "model.rope_theta": Real(0, 1e12, lo_open=True),
    "model.norm_eps": Real(0, 1, lo_open=True), "model.tie_embeddings": FLAG, "model.init_std": Real(0, 10, lo_open=True),
    "grid.levels": Domain("ints", 1, MAX_PATHS, items=(1, 64), max_product=MAX_PATHS, why=COSTLY),
    "grid.private_embed": FLAG, "grid.private_head": FLAG,
    "grid.replicas": Int(1, Rel(lambda c: MAX_PATHS // _paths(c), f"{MAX_PATHS} / the number of paths", ("grid.levels",)),
                          why="paths x replicas is bounded like paths"),
    "router.prefix_tokens": Int(1, Rel(lambda c: c.trainer.seq_len - 1, "trainer.seq_len - 1", ("trainer.seq_len",)),
                                 why="the routing prefix carries no loss"),
    "router.cluster_tokens": Int("router.prefix_tokens", "model.max_seq_len", null=True),
    "router.reroute_context": Int(1, 2**20, null=True), "router.method": OneOf(ROUTER_METHODS),
    "router.prompt_classifier": FLAG,
    "router.featurizer": OneOf(FEATURIZERS), "router.feature_dim": Int(1, 4096, why=COSTLY),
    "router.top_k": Int(1, _paths, why="a document goes to at most every path"),
    "router.capacity_factor": Real(1, 1e6), "router.balance": OneOf(ROUTER_BALANCES),
    "router.soft_capacity_factor": Real(1, 1e6),
    "router.reshard_at_round": Int(1, Rel(lambda c: c.trainer.rounds - 1, "trainer.rounds - 1", ("trainer.rounds",)), null=True,
                                   why="a re-shard happens between rounds"),
    "router.reshard_every": Int(1, 10**6, null=True), "router.reshard_documents": Int(1, 10**7, why=COSTLY),
    "router.reshard_assign": OneOf(RESHARD_ASSIGNS), "router.reroute_every": Int(1, 2**20, null=True),
    "diloco.inner_steps": Int(1, 10**7, why=COSTLY), "diloco.mode": OneOf(MODES),
    "diloco.outer.name": TEXT, "diloco.outer.lr": Real(0, 10, lo_open=True),
    "diloco.outer.momentum": Real(0, 0.999), "diloco.outer.nesterov": FLAG,
    "diloco.codec": OneOf(lambda: sorted(CODECS)), "diloco.codec_block": Int(1, 2**24),
    "diloco.codec_topk_fraction": Real(0, 1, lo_open=True), "diloco.error_feedback": FLAG,
    "diloco.lossy_exchange": OneOf(("auto", "reduce_scatter", "all_gather")), "diloco.sharing_rescale": FLAG,
    "diloco.alpha": OneOf(ALPHAS), "diloco.outer_device": OneOf(("auto", "cpu")),
    "diloco.streaming": FLAG, "diloco.streaming_spread": OneOf(("even", "size")),
    # bounded by H only when read: the default τ = 1 must not refuse H = 1 runs that do not stream
    "diloco.streaming_delay": Int(0, Rel(lambda c: c.diloco.inner_steps - 1 if c.diloco.streaming else _BIG,
                                         "diloco.inner_steps - 1", ("diloco.inner_steps", "diloco.streaming")),
                                  why="a module's exchange lands within its round"),
    "diloco.streaming_mix": Real(0, 0.999, why="1 would keep the live weights and never take the global ones"),
    "diloco.streaming_fragments": Int(1, Rel(lambda c: len(c.grid.levels) + 2, "the stages of a path (embed, "
                                             "each level, head)", ("grid.levels",)), null=True),
    "diloco.decoupled.workers": Int(1, MAX_PATHS, null=True),
    "diloco.decoupled.learners": Int(1, MAX_PATHS, null=True),  # deprecated name of workers
    "diloco.decoupled.sync_procs": Int(1, 1024),
    "diloco.decoupled.store_url": PATH, "diloco.decoupled.quorum": Real(0, 1, lo_open=True),
    "diloco.decoupled.grace_factor": Real(0, 1000, lo_open=True),
    "diloco.decoupled.grace_init_s": Real(0, 86400, lo_open=True),
    "diloco.decoupled.grace_min_s": Real(0, "diloco.decoupled.grace_max_s", lo_open=True, null=True),
    "diloco.decoupled.grace_max_s": Real(0, 86400, lo_open=True, null=True), "diloco.decoupled.max_staleness": Int(0, 10**6),
    "diloco.decoupled.staleness_power": Real(0, 100), "diloco.decoupled.momentum_every": Int(1, 10**6),
    "diloco.decoupled.momentum_scale": Real(0, 100), "diloco.decoupled.lease_s": Real(0, 86400, lo_open=True),
    "diloco.decoupled.heartbeat_s": Real(0, 3600, lo_open=True), "diloco.decoupled.pull_wait_s": Real(0, 86400),
    "diloco.decoupled.pull_wait_fraction": Real(0, 1, null=True), "diloco.decoupled.dynamic_steps": FLAG,
    "diloco.decoupled.min_phase_steps": Int(1, 10**7), "diloco.decoupled.slow_threshold": Real(1, 1000, lo_open=True),
    "diloco.decoupled.poll_s": Real(0, 60, lo_open=True), "diloco.decoupled.timeout_s": Real(0, 10**7, lo_open=True, null=True),
    "diloco.decoupled.stall_phases": Real(2, 10**6),
    "diloco.decoupled.restart_dead": FLAG, "diloco.decoupled.max_restarts": Int(0, 10**6),
    "diloco.decoupled.keep_archive": FLAG,
    "diloco.decoupled.slow_workers": Domain("ints", 0, MAX_PATHS - 1, items=(0, MAX_PATHS)),
    "diloco.decoupled.slow_learners": Domain("ints", 0, MAX_PATHS - 1, items=(0, MAX_PATHS)),  # deprecated name
    "diloco.decoupled.slow_factor": Real(1, 1000),
    "trainer.rounds": Int(1, 10**6, why=COSTLY), "trainer.total_steps": Int(1, _BIG, null=True, why=COSTLY),
    "trainer.lr_segments": Domain("ints", 0, "trainer.rounds", items=(0, 10**4), rising=True,
                                  why="[start, end, ...] rounds of each learning-rate segment"),
    "trainer.extend_schedule": OneOf(EXTEND_SCHEDULES),
    "trainer.batch_size": Int(1, 2**16, why=COSTLY), "trainer.seq_len": Int(2, "model.max_seq_len"),
    "trainer.lr": Real(0, 1, lo_open=True), "trainer.min_lr_ratio": Real(0, 1),
    "trainer.warmup_steps": Int(0, _BIG), "trainer.weight_decay": Real(0, 10), "trainer.beta1": Real(0, 0.9999),
    "trainer.beta2": Real(0, 0.99999), "trainer.grad_clip": Real(0, 1e6, why="0 turns clipping off"),
    "trainer.warmup_fraction": Real(0, 0.9, why="the warm-up is fraction / (1 - fraction) x the rounds' steps"),
    "trainer.dense_baseline": FLAG, "trainer.eval_max_documents": Int(1, _BIG, null=True),
    "trainer.eval_split": OneOf(("validation", "test")), "trainer.eval_batch_size": Int(1, 2**16, why=COSTLY),
    "trainer.eval_long": FLAG, "trainer.eval_seq_len": Int(2, "model.max_seq_len", null=True),
    "trainer.path_early_stopping": FLAG, "trainer.eval_every": Int(1, 10**6), "trainer.checkpoint_every": Int(1, 10**6),
    "trainer.keep_last": Int(1, 10**6), "trainer.stop_after_rounds": Int(1, "trainer.rounds", null=True),
    "trainer.threads": Int(1, 4096, null=True), "trainer.device": OneOf(DEVICES),
    "trainer.precision": OneOf(tuple(PRECISIONS)), "trainer.compile": MAYBE_FLAG, "trainer.compile_backend": TEXT,
    "trainer.activation_checkpointing": FLAG, "trainer.micro_batches": Int(1, "trainer.batch_size"),
    "trainer.deterministic": FLAG, "trainer.plots": FLAG, "trainer.progress": FLAG,
    "launcher.name": OneOf(LAUNCHERS), "launcher.nproc": Int(1, MAX_PATHS), "launcher.group_size": Int(1, MAX_PATHS),
    "launcher.group_parallel": OneOf(GROUP_PARALLEL), "launcher.backend": OneOf(BACKENDS),
    "launcher.timeout_s": Real(10, 10**7, why="ranks wait at a collective while rank 0 prepares the data; "
                                             "a shorter limit fails healthy runs"), "launcher.partition": MAYBE_TEXT,
    "launcher.nodes": Int(1, MAX_PATHS), "launcher.gpus_per_node": Int(1, 64, null=True),
    "launcher.cpus_per_task": Int(1, 4096, null=True), "launcher.mem_gb": Int(1, 10**6, null=True),
    "launcher.timeout_min": Int(1, 10**7), "launcher.account": MAYBE_TEXT, "launcher.qos": MAYBE_TEXT,
    "launcher.constraint": MAYBE_TEXT, "launcher.master_port": Int(1, 65535, why="a TCP port"),
    "launcher.max_requeues": Int(0, 1000, why="0 never requeues; each requeue waits in the queue again"),
    "launcher.dry_run": FLAG, "launcher.elastic": FLAG,
    "launcher.min_nproc": Int("launcher.group_size", "launcher.nproc", null=True),
    "launcher.max_restarts": Int(0, 1000, why="each restart re-runs the round in flight"),
    "launcher.rejoin_after_s": Real(0, 10**7, null=True),
    "logging.tensorboard": FLAG, "logging.wandb": FLAG, "logging.wandb_project": TEXT,
    "logging.wandb_entity": MAYBE_TEXT, "logging.wandb_mode": OneOf(WANDB_MODES),
    "logging.run_name": MAYBE_TEXT, "logging.wandb_group": MAYBE_TEXT, "logging.tags": Domain("texts"),
    "logging.every_steps": Int(0, 10**7, why="0 logs per round only"),
    "logging.val_documents": Int(0, 10**6, why="each is scored every round"),
    "logging.peak_tflops": Real(0, 1e6, lo_open=True, null=True, why="the device's dense peak, for MFU"),
    "resume": FLAG, "run_dir": PATH, "tag": MAYBE_TEXT,
    **{k: Domain(*spec) for k, spec in CLUSTER_DOMAINS.items()},  # dipaco-plan --simulate's cluster.*
}


def _method_domain(name: str, s: Setting) -> Domain:
    """The domain a routing method declares for its setting (``router.methods.base.setting``):
    its bounds, ``"paths"`` standing for the number of paths; null allowed where null is
    the default."""
    lo, hi = (_paths if b == "paths" else b for b in (s.metadata["lo"], s.metadata["hi"]))
    kind = next((t for t in (bool, int, float, str) if s.type in (t, Optional[t])), None)
    if kind is bool:
        return MAYBE_FLAG if s.default is None else FLAG
    if kind is str:
        return MAYBE_TEXT if s.default is None else TEXT
    if kind is None:
        raise TypeError(f"router.{name}: a routing method's setting must be a bool, int, float or str, not {s.type}")
    return Domain("int" if kind is int else "real", lo, hi, null=s.default is None, why=s.metadata["why"])


# every routing method's settings (niter, fine_clusters, ...) come with their domains
DOMAINS.update({f"router.{name}": _method_domain(name, s) for name, s in method_settings().items()})


def value_of(cfg: Any, key: str) -> Any:
    """The value of dotted ``key`` in ``cfg`` (dataclasses all the way down)."""
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _bound(b: Bound, cfg: Optional[Config]) -> tuple[Optional[float], str]:
    """A bound's number and how to say it (``8 (trainer.rounds)``); ``cfg=None``: only a
    constant bound counts (a relation to another key is checked in the second pass)."""
    if b is None or (cfg is None and not _is_number(b)):
        return None, ""
    if isinstance(b, str):
        v = value_of(cfg, b)
        return (None, "") if v is None else (v, f"{v} ({b})")
    if callable(b):
        v = b(cfg)
        return v, f"{v} ({b.what})" if isinstance(b, Rel) else str(v)
    return b, str(b)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def problem(dom: Domain, value: Any, cfg: Optional[Config]) -> Optional[str]:
    """Why ``value`` lies outside ``dom`` (``None``: it lies inside); with ``cfg=None``
    the bounds that relate it to other keys are not checked."""
    if value is None:
        return None if dom.null else "must be set (null is not allowed)"
    if dom.kind == "flag":
        return None if isinstance(value, bool) else f"{value!r} is not true or false"
    if dom.kind in ("text", "path"):
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            return f"{value!r} is not a usable {'path' if dom.kind == 'path' else 'name'} (empty, or a NUL byte)"
        return None
    if dom.kind == "texts":
        return None if all(isinstance(v, str) and v for v in value) else f"{list(value)!r} holds an empty name"
    if dom.kind == "choice":
        return None if value in dom.names() else f"unknown value {value!r}"
    if dom.kind == "ints":
        items, (least, most) = list(value), dom.items
        if not least <= len(items) <= most:
            return f"holds {len(items)} entries: needs {least} to {most}"
        for v in items:
            bad = _range(dom, v, cfg)
            if bad:
                return f"entry {bad}"
        if dom.max_product and math.prod(items) > dom.max_product:
            return f"{items} makes {math.prod(items):,}; at most {dom.max_product:,} ({dom.why})"
        if dom.rising and (len(items) % 2 or items != sorted(items) or any(a >= b for a, b in
                                                                           zip(items[0::2], items[1::2]))):
            return f"{items} is not [start, end, start, end, ...] with each start < its end <= the next start"
        return None
    return _range(dom, value, cfg)


def _range(dom: Domain, v: Any, cfg: Optional[Config]) -> Optional[str]:
    if not _is_number(v) or (dom.kind in ("int", "ints") and not isinstance(v, int)):
        return f"{v!r} is not {'an integer' if dom.kind != 'real' else 'a number'}"
    if not math.isfinite(v):
        return f"{v} is not a finite number"
    if dom.kind == "real" and 0 < abs(v) < TINY:
        return (f"{v} is below {TINY:.4g} (float32's smallest normal number), which tensors and timers read as 0 "
                "or overflow on: use 0 where 0 is allowed, or a larger value")
    lo, lo_s = _bound(dom.lo, cfg)
    hi, hi_s = _bound(dom.hi, cfg)
    low_ok = lo is None or (v > lo if dom.lo_open else v >= lo)
    if low_ok and (hi is None or v <= hi):
        return None
    if hi is not None and lo is not None and hi < lo:
        return f"cannot be set: its range [{lo_s}, {hi_s}] is empty"
    side = f"> {lo_s}" if dom.lo_open else f">= {lo_s}"
    rng = side if hi is None else f"{side} and <= {hi_s}"
    if lo == 0 and dom.lo_open or lo == 1 and dom.kind != "real":
        rng = f"positive ({rng})"
    # the bound's reason; "exhausts memory or time" only says why a value is too large
    why = dom.why if dom.why and (hi is not None and v > hi or dom.why != COSTLY) else ""
    return f"{v} is out of range: must be {rng}" + (f" ({why})" if why else "")


def check_domains(cfg: Config, keys: Optional[Iterable[str]] = None) -> None:
    """Raise :class:`ConfigError` for the first setting (of ``keys``, default all) outside
    its domain, in schema order.

    Two passes: every key against its own constant bounds first, then the bounds that
    relate it to other keys, so an out-of-range value is named itself, not a key whose
    range it bounds."""
    chosen = [k for k in _ORDER if keys is None or k in set(keys)]
    for context in (None, cfg):
        for key in chosen:
            dom = DOMAINS[key]
            bad = problem(dom, value_of(cfg, key), context)
            if bad:
                raise ConfigError(key, bad, _fix(key, dom, context))


def _reads(dom: Domain) -> list[str]:
    """The keys a domain's bounds read."""
    return [k for b in (dom.lo, dom.hi) for k in ((b,) if isinstance(b, str) else getattr(b, "keys", ()))]


def _dependency_order() -> list[str]:
    """Schema order, except that a key comes after every key its bounds read: a value out
    of its own range is then named itself, not through a key it bounds."""
    out: list[str] = []

    def visit(key: str, seen: tuple[str, ...] = ()) -> None:
        if key in out:
            return
        if key in seen:
            raise ValueError(f"domains read each other in a cycle: {' -> '.join(seen + (key,))}")
        for k in _reads(DOMAINS[key]):
            visit(k, seen + (key,))
        out.append(key)

    for key in DOMAINS:
        visit(key)
    return out


_ORDER = _dependency_order()


def _fix(key: str, dom: Domain, cfg: Optional[Config] = None) -> str:
    if dom.kind == "choice":
        return f"use one of {', '.join(map(str, dom.names()))}"
    default = value_of(_DEFAULTS, key)
    if cfg is not None and dom.kind == "int" and problem(dom, default, cfg):
        # the default is out of range too under these settings (diloco.streaming_delay=1
        # with diloco.inner_steps=1): suggest the nearest value that is in range
        lo, _ = _bound(dom.lo, cfg)
        hi, _ = _bound(dom.hi, cfg)
        near = min(max(default, lo if lo is not None else default), hi if hi is not None else default)
        if not problem(dom, near, cfg):
            return f"e.g. {key}={_show(near)} (the default, {_show(default)}, is out of range here too)"
    return f"e.g. {key}={_show(default)} (the default)"


_DEFAULTS = Config()


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


__all__ = ["DOMAINS", "Domain", "check_domains", "problem", "value_of", "MAX_PATHS", "TINY"]
