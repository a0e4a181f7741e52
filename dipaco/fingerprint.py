"""What each artefact of a run directory was made from, and refusing to mix them.

``fingerprints.json`` records, per artefact (tokenizer, warm-up, router, shards,
checkpoints), the fingerprint of the data it was made from and the config keys it
depends on. Preparation reuses an artefact only when its record matches what this run
would make. Otherwise a fresh run says so and rebuilds it; a resumed run refuses in one
line (its checkpoints were trained on the old artefact, so rebuilding would silently
mix two runs). Run directories made before fingerprints existed have no file at all:
a resume trusts them, with a log line.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

from dipaco.checkpoint import write_json
from dipaco.config import Config
from dipaco.resume import flat_config
from dipaco.run_dir import RunDir, RunDirError

FINGERPRINTS = "fingerprints.json"

# The config keys (prefixes) each artefact depends on, besides its inputs' fingerprints.
_DEPENDS_ON: dict[str, tuple[str, ...]] = {
    "tokenizer": ("data", "model.vocab_size"),
    "warmup": ("model", "seed", "trainer.batch_size", "trainer.seq_len", "trainer.lr", "trainer.min_lr_ratio",
               "trainer.warmup_steps", "trainer.weight_decay", "trainer.beta1", "trainer.beta2",
               "trainer.grad_clip"),
    "router": ("grid.levels", "router.prefix_tokens", "router.cluster_tokens", "router.reroute_context",
               "router.method", "router.featurizer", "router.feature_dim", "router.top_k", "router.capacity_factor", "router.balance",
               "router.soft_capacity_factor", "router.niter", "router.fine_clusters", "router.prompt_classifier", "seed"),
    "shards": ("grid.replicas", "seed"),
    "checkpoints": ("model", "grid", "diloco", "seed", "trainer.batch_size", "trainer.seq_len", "trainer.lr",
                    "trainer.min_lr_ratio", "trainer.warmup_steps", "trainer.weight_decay", "trainer.beta1",
                    "trainer.beta2", "trainer.grad_clip", "trainer.warmup_fraction"),
}
_IGNORED = ("data.cache_dir", "data.max_doc_chars",  # where the cache lives does not change the data
            # what these change is in the inputs already: the documents of each split (the
            # data fingerprint) and the text the BPE is trained on (bpe_text, dipaco/prepare_tokens.py)
            "data.splits", "data.tokenizer_sample_bytes", "data.tokenizer_sample_documents")
# Keys added since fingerprints exist whose "off" value is not null: a run directory
# recorded before them matches when this run leaves them at this value.
_ADDED_OFF = {"router.prompt_classifier": False}


def config_keys(cfg: Config, artefact: str) -> dict[str, Any]:
    """The values of the config keys ``artefact`` depends on."""
    prefixes = _DEPENDS_ON[artefact]
    return {k: v for k, v in flat_config(cfg).items()
            if k not in _IGNORED and any(k == p or k.startswith(p + ".") for p in prefixes)}


class Fingerprints:
    """The run directory's ``fingerprints.json``: check before reuse, record after writing."""

    def __init__(self, run: RunDir, cfg: Config, log: Callable[[str], None]) -> None:
        self.run, self.cfg, self.log = run, cfg, log
        self.path = run.root / FINGERPRINTS
        self.legacy = False
        try:
            self.saved: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            self.saved = {}
            # a run directory made before fingerprints: only a resume trusts what it holds
            self.legacy = cfg.resume and run.config.is_file()
        except ValueError as e:
            raise RunDirError(f"corrupt {self.path}: {e}; start a new run directory") from None

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
        if self.legacy:
            self.log(f"{what}: no fingerprints recorded (a run directory from an older dipaco); reusing it")
            return True
        why = _difference(recorded, want)
        if self.cfg.resume:
            raise RunDirError(f"{what} in {self.run.root} was made from something else than this run "
                              f"({why}); start a new run in another hydra.run.dir")
        self.log(f"{what} in {self.run.root} was made from something else ({why}); rebuilding it")
        return False

    def record(self, artefact: str, want: dict[str, Any]) -> None:
        """Record that ``artefact`` on disk was made from ``want`` (atomic rewrite)."""
        self.saved[artefact] = want
        write_json(self.path, self.saved)


def _matches(recorded: Optional[dict], want: dict) -> bool:
    """``recorded == want``, except that a config key the recording dipaco did not know yet
    matches when this run leaves it null, or at its :data:`_ADDED_OFF` value (an option
    added since is off there: the run directory of an older dipaco stays resumable)."""
    if recorded is None:
        return False
    if set(recorded) - set(want):
        return False
    return all(recorded[k] == v if k in recorded else v is _ADDED_OFF.get(k) or v is None
               for k, v in want.items())


def _difference(recorded: Optional[dict], want: dict) -> str:
    if recorded is None:
        return "no fingerprint recorded"
    for key in sorted(set(recorded) | set(want)):
        if recorded.get(key) != want.get(key):
            return f"{key}: made with {_short(recorded.get(key))}, this run has {_short(want.get(key))}"
    return "unknown difference"


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 20 else s[:16] + "..."
