"""What each artefact of a run directory was made from, and refusing to mix them.

``fingerprints.json`` records, per artefact (tokenizer, warm-up, router, shards,
checkpoints), the fingerprint of the data it was made from and the config keys it
depends on, and under ``outputs`` the sha256 of each artefact as written. Preparation
reuses an artefact only when its record matches what this run would make. Otherwise a
fresh run says so and rebuilds it; a resumed run refuses in one line (its checkpoints
were trained on the old artefact, so rebuilding would silently mix two runs). A missing
record is never a pass: a run directory holding artefacts but no ``fingerprints.json``
(deleted, or from a dipaco before them), or an artefact without its recorded sha256, is
refused by every command that reads it (:func:`read_fingerprints`, :func:`verify_outputs`).

Every read checks the files themselves too (docs/design.md contract 9):
:func:`verify_outputs` refuses a ``tokenizer.json``, ``router/``, ``shards/`` or
``warmup/`` that is not the one recorded (say, copied from another run), and
:func:`verify_checkpoint` a checkpoint that this run did not write (its ``state.json``
carries :func:`checkpoint_stamp`). :func:`preflight_resume` makes every check a resume
makes, before the resume writes anything.
"""
from __future__ import annotations

import json
from pathlib import Path
from dataclasses import fields
from typing import Any, Callable, Optional

from dipaco.storage.atomic import write_json
from dipaco.run.checkpoint import MANIFEST, CheckpointError, CheckpointManager
from dipaco.storage.hashing import sha256_file, sha256_json
from dipaco.config import Config
from dipaco.run.resume import allowed_on_resume, flat_config
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.config.schedule import warmup_steps
from router.methods import method_settings
from router.settings import RouterSettings

FINGERPRINTS = "fingerprints.json"
OUTPUTS = "outputs"  # sha256 of each artefact's file as written, by artefact
# The file whose sha256 stands for each artefact (a manifest where the artefact is a folder).
_OUTPUT_FILE: dict[str, Callable[[RunDir], Path]] = {
    "tokenizer": lambda run: run.tokenizer,
    "router": lambda run: run.router / "manifest.json",
    "shards": lambda run: run.shards / "shards.json",
    "warmup": lambda run: run.warmup / "modules.safetensors",
}
# What artefacts are made from besides config keys (fingerprints of data and other artefacts).
_INPUTS = ("data", "tokenizer", "given", "bpe_text", "features", "router")
_WHAT = {"tokenizer": "tokenizer.json", "warmup": "warmup/", "router": "router/", "shards": "shards/",
         "checkpoints": "checkpoints/"}

# The config keys (prefixes) each artefact depends on, besides its inputs' fingerprints.
_DEPENDS_ON: dict[str, tuple[str, ...]] = {
    "tokenizer": ("data", "model.vocab_size"),
    "warmup": ("model", "seed", "trainer.batch_size", "trainer.seq_len", "trainer.lr", "trainer.min_lr_ratio",
               "trainer.warmup_steps", "trainer.weight_decay", "trainer.beta1", "trainer.beta2",
               "trainer.grad_clip"),
    # the router's settings and every routing method's, as declared in router/ (router.settings,
    # router.methods): a setting a new method brings is part of the router's fingerprint
    "router": ("grid.levels", "router.method", "router.featurizer", "router.feature_dim",
               *(f"router.{f.name}" for f in fields(RouterSettings)), *(f"router.{n}" for n in method_settings()),
               "seed"),
    "shards": ("grid.replicas", "seed"),
    "checkpoints": ("model", "grid", "diloco", "seed", "trainer.batch_size", "trainer.seq_len", "trainer.lr",
                    "trainer.min_lr_ratio", "trainer.warmup_steps", "trainer.weight_decay", "trainer.beta1",
                    "trainer.beta2", "trainer.grad_clip", "trainer.warmup_fraction"),
}
_IGNORED = ("data.cache_dir", "data.max_doc_chars",  # where the cache lives does not change the data
            # what these change is in the inputs already: the documents of each split (the
            # data fingerprint) and the text the BPE is trained on (bpe_text, dipaco/job/prepare_tokens.py)
            "data.splits", "data.tokenizer_sample_bytes", "data.tokenizer_sample_documents",
            # which installed packages give the multidomain corpus: its documents, in the data
            # fingerprint (a run recorded before the key resumes when its corpus is the same)
            "data.packages")
# Recorded by earlier dipacos, no longer part of what an artefact is made from: a resume
# may change it (a run recorded with it stays resumable with another value).
_NO_LONGER_DEPENDS = frozenset({"diloco.outer_device"})
# Keys added since fingerprints exist whose "off" value is not null: a run directory
# recorded before them matches when this run leaves them at this value.
_ADDED_OFF = {"router.prompt_classifier": False}


def artefact_depends(key: str, artefact: str) -> bool:
    """Whether config ``key`` shapes ``artefact``: keys a resume may change (they say how a
    run executes, :data:`dipaco.run.resume.ALLOWED_ON_RESUME`) never do."""
    return artefact in _DEPENDS_ON and key not in _IGNORED and not allowed_on_resume(key) and \
        any(key == p or key.startswith(p + ".") for p in _DEPENDS_ON[artefact])


def config_keys(cfg: Config, artefact: str) -> dict[str, Any]:
    """The values of the config keys ``artefact`` depends on."""
    return {k: v for k, v in flat_config(cfg).items() if artefact_depends(k, artefact)}


class Fingerprints:
    """The run directory's ``fingerprints.json``: check before reuse, record after writing."""

    def __init__(self, run: RunDir, cfg: Config, log: Callable[[str], None]) -> None:
        self.run, self.cfg, self.log = run, cfg, log
        self.path = run.root / FINGERPRINTS
        self.saved: dict[str, Any] = read_fingerprints(run)

    def want(self, artefact: str, **inputs: Any) -> dict[str, Any]:
        """What ``artefact`` must have been made from: its inputs and config keys."""
        return {**inputs, **config_keys(self.cfg, artefact)}

    def reusable(self, artefact: str, want: dict[str, Any], present: bool, what: str) -> bool:
        """True: reuse the artefact on disk. False: (re)build it. Raises on a resume."""
        if not present:
            return False
        recorded = self.saved.get(artefact)
        if _matches(recorded, want):
            return True
        why = _difference(recorded, want)
        if self.cfg.resume:
            raise RunDirError(f"{what} in {self.run.root} was made from something else than this run "
                              f"({why}); start a new run in another hydra.run.dir")
        self.log(f"{what} in {self.run.root} was made from something else ({why}); rebuilding it")
        return False

    def record(self, artefact: str, want: dict[str, Any]) -> None:
        """Record that ``artefact`` on disk was made from ``want``, and its sha256 as written
        (atomic rewrite). Shards are made from the router on disk (a re-shard rewrites both),
        so recording them records the router's file too."""
        self.saved[artefact] = want
        outputs = self.saved.setdefault(OUTPUTS, {})
        for name in (artefact, "router") if artefact == "shards" else (artefact,):
            if name in _OUTPUT_FILE and _OUTPUT_FILE[name](self.run).is_file():
                outputs[name] = sha256_file(_OUTPUT_FILE[name](self.run))
        write_json(self.path, self.saved)


def held_artefacts(run: RunDir) -> list[str]:
    """The artefacts ``run`` holds on disk (``tokenizer.json``, ``router/``, ...), by name."""
    held = [_WHAT[a] for a, f in _OUTPUT_FILE.items() if f(run).is_file()]
    if run.checkpoints.is_dir() and any(run.checkpoints.iterdir()):
        held.append(_WHAT["checkpoints"])
    return held


def read_fingerprints(run: RunDir) -> dict[str, Any]:
    """``fingerprints.json`` of ``run``: ``{}`` where the run holds no artefact yet; a
    :class:`RunDirError` where it holds some but the record is missing or unreadable
    (what they were made from is unknown: never a pass)."""
    path = run.root / FINGERPRINTS
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        held = held_artefacts(run)
        if held:
            raise RunDirError(f"{run.root} holds {', '.join(held)} but no {FINGERPRINTS}: what they were made "
                              "from cannot be checked, so they are not used; start a new run in another "
                              "hydra.run.dir (or put the run's own fingerprints.json back)") from None
        return {}
    except (OSError, ValueError) as e:
        raise RunDirError(f"corrupt {path}: {e}; start a new run directory") from None
    if not isinstance(saved, dict):
        raise RunDirError(f"corrupt {path}: not a JSON object; start a new run directory")
    return saved


def _expected_outputs(saved: dict[str, Any]) -> dict[str, str]:
    """The sha256 each artefact's file must have: recorded under ``outputs``, or, in a run
    directory from before them, what the router and the shards records were made from."""
    out = {k: v for k, v in saved.get(OUTPUTS, {}).items() if isinstance(v, str)}
    legacy = {"tokenizer": saved.get("router", {}).get("tokenizer"), "router": saved.get("shards", {}).get("router")}
    return {**{k: v for k, v in legacy.items() if isinstance(v, str)}, **out}


def verify_outputs(run: RunDir, artefacts: tuple[str, ...] = tuple(_OUTPUT_FILE)) -> None:
    """Refuse, in one line, an artefact on disk whose sha256 is not the one
    ``fingerprints.json`` records (replaced by hand, or copied from another run)."""
    expected = _expected_outputs(read_fingerprints(run))
    for artefact in artefacts:
        path = _OUTPUT_FILE[artefact](run)
        if not path.is_file():
            continue  # a missing file is reported by whoever needs it, naming it
        want = expected.get(artefact)
        if want is None:  # a record deleted or never written: unknown is not a pass
            raise RunDirError(f"{path}: {FINGERPRINTS} records no sha256 for it, so it cannot be checked as the "
                              f"{artefact} this run was made with; start a new run in another hydra.run.dir")
        got = sha256_file(path)
        if got != want:
            raise RunDirError(f"{path} is not the {artefact} this run was made with (sha256 {got[:12]}..., "
                              f"{FINGERPRINTS} records {want[:12]}...): it was replaced or copied from another "
                              "run; put the run's own back, or start a new run in another hydra.run.dir")


def checkpoint_stamp(run: RunDir) -> Optional[str]:
    """What this run's checkpoints are made from, as one hash (of the ``checkpoints``
    record of ``fingerprints.json``), written into each checkpoint's ``state.json``."""
    rec = read_fingerprints(run).get("checkpoints")
    if rec is None:
        return None
    return sha256_json(rec)


def verify_checkpoint(run: RunDir, ckpt: Path) -> None:
    """Refuse (:class:`CheckpointError`) a checkpoint that this run did not write: no
    ``state.json`` (an export copied under ``checkpoints/``), another round than its
    name, the stamp of other artefacts, or no stamp where the run records one."""
    state_file = Path(ckpt) / "state.json"
    fix = f"move it out of {run.checkpoints}, or pass the checkpoint to use"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt} has no state.json: it is not a checkpoint written by a dipaco run "
                              f"(an export?); {fix}") from None
    except ValueError as e:
        raise CheckpointError(f"unreadable {state_file}: {e}; {fix}") from None
    name = Path(ckpt).name
    if name.startswith("round_") and name[6:].isdigit() and state.get("round") != int(name[6:]):
        raise CheckpointError(f"{ckpt} holds round {state.get('round')!r}, not the round its name says; {fix}")
    stamp, want = state.get("made_from"), checkpoint_stamp(run)
    if stamp is None and want is not None:
        raise CheckpointError(f"{ckpt} carries no stamp of what it was made from ({FINGERPRINTS} records one): "
                              f"it cannot be checked as this run's; {fix}")
    if want is not None and stamp != want:
        raise CheckpointError(f"{ckpt} was made from other artefacts than this run's (its stamp {stamp[:12]}..., "
                              f"{FINGERPRINTS} says {want[:12]}...): it comes from another run; {fix}")


def check_config(run: RunDir, cfg: Config, fix: str, artefacts: Optional[tuple[str, ...]] = None) -> None:
    """Refuse (:class:`RunDirError`, one line naming the first key that differs) a config
    whose keys are not those ``run``'s recorded artefacts were made with: the one rule for a
    resume and for every read of a finished run (a ``config.yaml`` edited after training
    would otherwise build the weights into another model, silently). ``artefacts``: the
    records to check (default: every one); ``checkpoints`` binds once a checkpoint exists."""
    saved = read_fingerprints(run)
    trained = "checkpoints/" in held_artefacts(run)
    for artefact, recorded in saved.items():
        if artefact not in _DEPENDS_ON or not isinstance(recorded, dict):
            continue
        if artefacts is not None and artefact not in artefacts:
            continue
        if artefact == "checkpoints" and not trained:
            continue  # what training would be made from binds nothing before a checkpoint exists
        want = config_keys(cfg, artefact)
        if artefact == "warmup":
            want["steps"] = warmup_steps(cfg)
        mine = {k: v for k, v in recorded.items() if k not in _INPUTS}  # its config keys (+ warm-up steps)
        if not _matches(mine, want):
            raise RunDirError(f"{_WHAT[artefact]} in {run.root} was made from something else than this run "
                              f"({_difference(mine, want)}); {fix}")


def preflight_resume(run: RunDir, cfg: Config) -> None:
    """Every check a resume makes of what ``run`` holds, before anything is written: the
    config keys each recorded artefact was made with, the artefacts' files, and every
    checkpoint it might continue from (its stamp; the hashes are checked when one is
    chosen). (The data's fingerprint needs the corpus: preparation checks it, with the
    tokenizer, before it writes.)"""
    check_config(run, cfg, fix="start a new run in another hydra.run.dir")
    verify_outputs(run)
    mgr = CheckpointManager(run.checkpoints)
    for r in mgr.list_rounds():  # every checkpoint the resume might continue from, without hashing
        ckpt = mgr.final_dir(r)
        try:
            files = json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # damaged: the resume skips it, with a log line (docs/reliability.md)
        state = ckpt / "state.json"
        info = files.get("state.json") if isinstance(files, dict) else None
        if info is not None and not (state.is_file() and isinstance(info, dict) and state.stat().st_size ==
                                     info.get("bytes") and sha256_file(state) == info.get("sha256")):
            continue  # its state.json is damaged (missing, cut, garbled): skipped the same way, with a line
        verify_checkpoint(run, ckpt)


def _matches(recorded: Optional[dict], want: dict) -> bool:
    """``recorded == want``, except that a config key the recording dipaco did not know yet
    matches when this run leaves it null, or at its :data:`_ADDED_OFF` value (an option
    added since is off there: the run directory of an older dipaco stays resumable)."""
    if recorded is None:
        return False
    if set(recorded) - set(want) - _NO_LONGER_DEPENDS:
        return False
    return all(recorded[k] == v if k in recorded else v is _ADDED_OFF.get(k) or v is None
               for k, v in want.items())


def _difference(recorded: Optional[dict], want: dict) -> str:
    if recorded is None:
        return "no fingerprint recorded"
    for key in sorted((set(recorded) - _NO_LONGER_DEPENDS) | set(want)):
        if recorded.get(key) != want.get(key):
            return f"{key}: made with {_short(recorded.get(key))}, this run has {_short(want.get(key))}"
    return "unknown difference"


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 20 else s[:16] + "..."
