"""``resume=true``: the run's own saved config is the truth; the command line may change
only what does not shape the run.

A run directory's ``config.yaml`` says how its tokenizer, router, shards and checkpoints
were made. Resuming with another model, grid, data or schedule would train the saved
weights against artefacts and settings they were never made with, so such an override
is refused, naming the key, the saved value and the given one. What may change on a
resume is how the same run is executed (launcher, backend, progress bars, plots,
checkpoint cadence) and how long it goes on (more rounds).

Everything here only *reads* the run directory: a refusal leaves it byte-identical.
"""
from __future__ import annotations

import copy
import json
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from dipaco.config import Config, ConfigError, to_config
from dipaco.run.checkpoint import CheckpointError, CheckpointManager
from dipaco.run.record import FINGERPRINTS, flat_config, hand_edits
from dipaco.run.run_dir import RUN_LAYOUT, RunDir, RunDirError
from dipaco.config.schedule import extended_segments

# Keys (or key prefixes) a resume may change: they say how the run executes, not what it
# computes. Everything else shapes the run (data, tokenizer, model, grid, router, seed,
# DiLoCo, the inner schedule) and must stay as saved.
ALLOWED_ON_RESUME = (
    "launcher", "trainer.progress", "trainer.plots", "trainer.threads", "trainer.checkpoint_every",
    "trainer.keep_last", "trainer.eval_batch_size", "trainer.deterministic",
    "diloco.outer_device", "trainer.stop_after_rounds", "trainer.rounds",
    "trainer.total_steps", "trainer.extend_schedule", "data.cache_dir", "tag", "logging",
)
# May only grow: a resume adds rounds, it cannot un-train them.
_ONLY_MORE = ("trainer.rounds", "trainer.total_steps")
# Not settings of the run at all.
_IGNORED = ("resume", "run_dir")
# Config groups whose choice (``experiment=smoke``) may set keys anywhere.
_GLOBAL_GROUPS = ("experiment", "sweep")


def override_keys(overrides: list[str]) -> set[str]:
    """The config keys a Hydra command line sets: ``model=tiny`` → ``model`` (all of it),
    ``+trainer.lr=1`` → ``trainer.lr``; a global overlay (``experiment=X``) → ``*``."""
    keys: set[str] = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~").replace("/", ".")
        if key.startswith("hydra"):
            continue
        keys.add("*" if key in _GLOBAL_GROUPS else key)
    return keys


def _covered(key: str, explicit: Optional[set[str]]) -> bool:
    if explicit is None or "*" in explicit:
        return True
    return any(key == e or key.startswith(e + ".") for e in explicit)


def allowed_on_resume(key: str) -> bool:
    """Whether a resume may change ``key``: it says how the run executes, not what it computes."""
    return any(key == a or key.startswith(a + ".") for a in ALLOWED_ON_RESUME)


def resume_config(given: Config, run: RunDir, overrides: Optional[list[str]] = None,
                  may_change: Callable[[str], bool] = allowed_on_resume, trained: bool = True,
                  log: Callable[[str], None] = lambda _m: None) -> tuple[Config, dict[str, list[Any]]]:
    """The config to resume ``run`` with, and the allowed changes ``{key: [saved, given]}``.

    ``overrides`` is the command line (Hydra's task overrides): only keys it sets count
    as asked for, every other key comes from the saved config. ``None`` (the Python API)
    means every key of ``given`` was asked for. Raises :class:`ConfigError` for a change
    of a key that shapes the run, :class:`RunDirError` for an unreadable saved config.
    ``may_change``: the keys this continuation may change (a routed directory that has
    not trained yet: :mod:`dipaco.run.routed`); ``trained=False``: rounds may also shrink.
    """
    saved = run.load_config()
    explicit = None if overrides is None else override_keys(overrides)
    s, g = flat_config(saved), flat_config(given)
    changes: dict[str, list[Any]] = {}
    for key, (ran, edited) in hand_edits(run, saved, log).items():  # config.yaml edited since it was written
        if not may_change(key):
            raise ConfigError(key, f"{run.config} says {key}={edited!r} but the run ran with {ran!r} "
                                   f"({FINGERPRINTS}): it was edited by hand, and this key shapes the run",
                              f"put {key}: {ran!r} back in config.yaml, or start a new run in another hydra.run.dir")
        changes[key] = [ran, edited]  # honoured, and recorded as a change of this resume
    for key in sorted(set(s) | set(g)):
        sv, gv = s.get(key), g.get(key)
        if key in _IGNORED or sv == gv or not _covered(key, explicit):
            continue
        fix = (f"drop {key}=... (resume=true needs only hydra.run.dir), or start a new run in "
               "another hydra.run.dir") if trained else \
            f"drop {key}=... (the directory's own config.yaml is used), or route again into another hydra.run.dir"
        if not may_change(key):
            made = (f"{run.root} was trained with {key}={sv!r}; this resume asks for {gv!r}, which would change "
                    "the run") if trained else \
                (f"{run.root} holds artefacts made with {key}={sv!r} (router, shards, tokenizer); training on it "
                 f"continues from them and cannot use {gv!r}")
            raise ConfigError(key, made, fix)
        if trained and key in _ONLY_MORE and sv is not None and (gv is None or gv < sv):
            raise ConfigError(key, f"{run.root} was trained with {key}={sv!r}; a resume may add rounds, "
                                   f"not remove them (asked for {gv!r})", fix)
        changes[key] = [sv, gv]
    cfg = copy.deepcopy(saved)
    merged = OmegaConf.structured(cfg)
    for key, (_, gv) in changes.items():
        OmegaConf.update(merged, key, gv, merge=False)
    cfg = to_config(merged)
    # A stop (trainer.stop_after_rounds) belongs to the launch that asked for it: a
    # resume goes on to the end unless this command line asks for a stop again (the same
    # value as the first launch's included: asked for is asked for).
    if explicit is not None and not _covered("trainer.stop_after_rounds", explicit):
        cfg.trainer.stop_after_rounds = None
    elif explicit is not None:
        cfg.trainer.stop_after_rounds = given.trainer.stop_after_rounds
    elif explicit is None:
        cfg.trainer.stop_after_rounds = given.trainer.stop_after_rounds
    cfg.resume, cfg.run_dir = True, given.run_dir
    if trained:  # untrained: the schedule is a fresh run's over the rounds asked for
        _extend_schedule(cfg, saved, changes)
    return cfg, changes


def _extend_schedule(cfg: Config, saved: Config, changes: dict[str, list[Any]]) -> None:
    """More rounds than the launch's: ``trainer.lr_segments`` records what the learning
    rate does over them (``trainer.extend_schedule``, :mod:`dipaco.config.schedule`), as a change
    of the resume (logged, ``resumes.jsonl``)."""
    t, H = cfg.trainer, cfg.diloco.inner_steps
    rounds = t.total_steps // H if t.total_steps is not None and H >= 1 else t.rounds
    segments = extended_segments(saved.trainer.rounds, saved.trainer.lr_segments, rounds, t.extend_schedule)
    if rounds > saved.trainer.rounds and segments != list(saved.trainer.lr_segments):
        changes["trainer.lr_segments"] = [list(saved.trainer.lr_segments), segments]
        t.lr_segments = segments


def finished_summary(cfg: Config, run: RunDir, log: Callable[[str], None] = lambda _m: None
                     ) -> Optional[dict[str, Any]]:
    """The saved summary when ``run`` already trained all of ``cfg.trainer.rounds`` and its
    final checkpoint verifies. A damaged final checkpoint is not "nothing to do": the
    resume goes on from the newest checkpoint that verifies and re-makes the rest."""
    if not run.summary.is_file():
        return None
    try:
        summary = json.loads(run.summary.read_text(encoding="utf-8"))
    except ValueError:
        return None  # a torn summary: finish the run again, it is rewritten atomically
    if int(summary.get("rounds", -1)) < cfg.trainer.rounds:
        return None
    mgr = CheckpointManager(run.checkpoints)
    rounds = mgr.list_rounds()
    try:
        if not rounds:
            raise CheckpointError(f"no checkpoint under {run.checkpoints}")
        mgr.verify(mgr.final_dir(rounds[-1]))
    except CheckpointError as e:
        log(f"{run.root} is finished but its final checkpoint is damaged ({e}); repairing it from the newest "
            "checkpoint that verifies")
        return None
    return summary


def check_fresh(run: RunDir) -> None:
    """A fresh run (resume=false) refuses a directory holding another run's training, or
    anything dipaco did not write (a fresh run replaces ``tb/``, ``metrics.jsonl``, shards:
    in a folder of other files it would destroy them)."""
    names = {p.name for p in run.root.iterdir()} if run.root.is_dir() else set()
    foreign = sorted(names - RUN_LAYOUT)
    if not run.config.is_file():  # dipaco writes config.yaml first: what it replaces was not its own
        foreign += sorted(names & {"tb", "metrics.jsonl", "steps.jsonl"})
    if foreign or (run.config.is_file() and not _is_dipaco_config(run)):
        what = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "") if foreign else "a config.yaml of its own"
        raise RunDirError(f"{run.root} is not empty and is not a dipaco run directory (it holds {what}); a new "
                          "run writes only into a new or empty directory, or one dipaco made: choose another "
                          "hydra.run.dir")
    ckpts = run.checkpoints
    if ckpts.is_dir() and any(ckpts.iterdir()):
        raise ConfigError("resume", f"{run.root} already holds checkpoints",
                          "pass resume=true to continue it, or choose another hydra.run.dir")
    if run.summary.exists():
        raise ConfigError("resume", f"{run.root} already holds a finished run (summary.json)",
                          "choose another hydra.run.dir")


def _is_dipaco_config(run: RunDir) -> bool:
    try:
        run.load_config()
    except (RunDirError, ConfigError):
        return False
    return True


def has_saved_config(run: RunDir) -> bool:
    """Whether ``run`` holds a config to resume from; refuses checkpoints without one."""
    if run.config.is_file():
        return True
    if run.checkpoints.is_dir() and any(run.checkpoints.iterdir()):
        raise RunDirError(f"{run.root} holds checkpoints but no config.yaml: the settings they were "
                          "trained with are unknown, so the run cannot be resumed safely")
    return False
