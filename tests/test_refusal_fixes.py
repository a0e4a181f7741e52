"""A refusal's fix works: every configuration refusal of dipaco/config/validate.py (and dipaco/job/preflight.py) that
proposes a fix is applied to the refused command here, and the command with the fix is
accepted. The fix is read from the message itself (its first ``key=value``, or ``drop
KEY``), so a message that names the wrong key or a value that does not work fails here.
A source scan makes sure no refusal of validate.py is left out of the table. (The keys'
domains and where they apply have the same test in tests/test_config_domains.py and
tests/test_config_applies.py.)"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Optional

import pytest

from _compose import compose
from dipaco.config import ConfigError
from dipaco.job.preflight import preflight  # validate_config, then the checks that ask torch and the machine

SMOKE = ["experiment=smoke"]
VALIDATE = Path(__file__).resolve().parents[1] / "dipaco" / "config" / "validate.py"
PREFLIGHT = Path(__file__).resolve().parents[1] / "dipaco" / "job" / "preflight.py"
# placeholders some fixes name (a file, a partition): what the user would type
PLACEHOLDERS = {"FILE": "/data/corpus.jsonl", "NAME": "gpu"}

# (refused overrides on top of the smoke config, the key the refusal names)
CASES: list[tuple[list[str], str]] = [
    (["data=jsonl", "data.path=null"], "data.path"),
    (["grid.replicas=2", "grid.levels=[1,1]", "diloco.mode=decoupled"], "grid.replicas"),
    (["diloco.outer.momentum=0", "diloco.outer.nesterov=true"], "diloco.outer.nesterov"),
    (["router.featurizer=lm", "trainer.warmup_fraction=0"], "router.featurizer"),
    (["router.balance=soft", "router.capacity_factor=3", "router.soft_capacity_factor=2"],
     "router.soft_capacity_factor"),
    (["router=random", "router.prompt_classifier=true"], "router.prompt_classifier"),
    (["launcher=spawn", "launcher.nproc=2", "launcher.group_size=2", "trainer.batch_size=5"], "trainer.batch_size"),
    (["diloco.streaming=true", "diloco.mode=decoupled"], "diloco.streaming"),
    (["trainer.eval_seq_len=200"], "trainer.eval_seq_len"),
    (["trainer.eval_seq_len=16"], "trainer.eval_seq_len"),
    (["trainer.eval_split=test", "data.test_fraction=0"], "trainer.eval_split"),
    (["trainer.path_early_stopping=true", "diloco.mode=decoupled"], "trainer.path_early_stopping"),
    (["trainer.path_early_stopping=true", "router.reshard_at_round=1"], "trainer.path_early_stopping"),
    (["router.reshard_every=1"], "router.reshard_every"),
    (["router.reshard_at_round=1", "diloco.mode=decoupled"], "router.reshard_at_round"),
    (["launcher.group_parallel=fsdp"], "launcher.group_parallel"),
    (["launcher=spawn", "launcher.nproc=2", "launcher.group_size=2", "launcher.group_parallel=fsdp",
      "diloco.codec=int8"], "launcher.group_parallel"),
    (["launcher=slurm", "launcher.nproc=4"], "launcher.partition"),
    (["launcher=slurm", "launcher.partition=gpu", "launcher.nproc=4", "launcher.gpus_per_node=2"],
     "launcher.nproc"),
    (["launcher=local", "launcher.elastic=true"], "launcher.elastic"),
    (["launcher=spawn", "launcher.nproc=2", "launcher.elastic=true", "diloco.mode=decoupled"], "launcher.elastic"),
    (["launcher=spawn", "launcher.nproc=2", "launcher.elastic=true", "router.reshard_at_round=1"],
     "launcher.elastic"),
    (["launcher=spawn", "launcher.nproc=4", "launcher.group_size=2", "launcher.elastic=true",
      "launcher.min_nproc=3"], "launcher.min_nproc"),
    (["launcher=spawn", "launcher.nproc=3", "launcher.group_size=2"], "launcher.nproc"),
    (["launcher=spawn", "launcher.nproc=8"], "launcher.nproc"),
    (["launcher=slurm", "launcher.partition=gpu", "launcher.nodes=2", "launcher.nproc=8"], "launcher.nproc"),
    (["trainer.total_steps=10"], "trainer.total_steps"),
    (["trainer.rounds=3", "trainer.total_steps=8"], "trainer.rounds"),
    (["data.documents_per_path=10", "data.max_train_documents=7"], "data.documents_per_path"),
    (["diloco.outer.name=lbfgs"], "diloco.outer.name"),
    (["diloco.outer.name=adam", "diloco.outer.momentum=0.5"], "diloco.outer.momentum"),
    (["model.d_model=64", "model.n_heads=3"], "model.n_heads"),
    (["model.d_model=2", "model.n_heads=2"], "model.n_heads"),
    (["model.d_model=63", "model.n_heads=1"], "model.d_model"),
    (["diloco.mode=decoupled", "diloco.decoupled.workers=2", "diloco.decoupled.learners=3"],
     "diloco.decoupled.learners"),
    (["diloco.mode=decoupled", "diloco.decoupled.slow_workers=[0]", "diloco.decoupled.slow_learners=[1]"],
     "diloco.decoupled.slow_learners"),
    (["diloco.mode=decoupled", "diloco.decoupled.lease_s=1", "diloco.decoupled.heartbeat_s=1"],
     "diloco.decoupled.lease_s"),
]
# refusals whose fix cannot be applied by a test: what the user must do outside dipaco
NOT_APPLICABLE = {
    "logging.wandb": "pip install wandb",
    "model": "a model group's own consistency (conf/model/): the message says which numbers disagree",
    "diloco.outer": "an outer step that overflows: how far to lower the lr depends on the optimiser",
    "launcher.group_size": "fsdp on a GPU node: a divisor of the model's widths",
    "model.vocab_size": "needs a tokenizer file: tests/test_tokenizer_reuse.py applies its fix",
    "data.tokenizer": "an unreadable tokenizer path: the fix is a tokenizer file the user has",
}


@functools.lru_cache(maxsize=None)
def _refusal(overrides: tuple[str, ...]) -> Optional[ConfigError]:
    try:
        preflight(compose(list(overrides)))
    except ConfigError as e:
        return e
    return None


def apply_fix(overrides: list[str], message: str) -> list[str]:
    """The refused command with the fix of ``message`` applied: its first ``key=value``
    (a group choice or a key) set, or its first ``drop KEY`` removed."""
    fix = message.split("Fix:", 1)[1]
    first = re.split(r"[;,]| or ", fix)[0]
    dropped = re.match(r"\s*drop ([\w.]+)", first)
    if dropped:
        key = dropped.group(1)
        return [o for o in overrides if not o.split("=", 1)[0] in (key, f"+{key}")]
    given = re.findall(r"([\w][\w./]*)=([\w./\[\]-]+)", first)
    assert given, f"the fix names no override to apply: {message}"
    out = list(overrides)
    for key, value in given:
        out = [o for o in out if o.split("=", 1)[0] != key] + [f"{key}={PLACEHOLDERS.get(value, value)}"]
    return out


@pytest.mark.parametrize("overrides, key", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_the_fix_a_refusal_proposes_is_accepted(overrides: list[str], key: str) -> None:
    refused = SMOKE + overrides
    err = _refusal(tuple(refused))
    assert err is not None, f"{overrides} was accepted: the case no longer reaches its refusal"
    assert err.key == key, str(err)
    fixed = apply_fix(refused, str(err))
    again = _refusal(tuple(fixed))
    assert again is None, f"the fix of\n  {err}\nwas applied ({fixed}) and refused again:\n  {again}"


def _refused_keys() -> set[str]:
    """Every key a refusal in validate.py (or the preflight after it) names as a string literal."""
    keys = set()
    for node in (n for f in (VALIDATE, PREFLIGHT) for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("require", "ConfigError"):
            i = 1 if node.func.id == "require" else 0
            if len(node.args) > i and isinstance(node.args[i], ast.Constant):
                keys.add(node.args[i].value)
    return keys


def test_every_refusal_of_validate_has_a_case_here() -> None:
    covered = {key for _, key in CASES} | set(NOT_APPLICABLE)
    missing = _refused_keys() - covered
    assert not missing, f"refusals without a case whose fix is applied: {sorted(missing)}"


def test_apply_fix_reads_the_message() -> None:
    msg = "config error: a.b: bad. Fix: use launcher=spawn launcher.group_size=2 (or more), or drop a.b"
    assert apply_fix(["launcher=local", "a.b=1"], msg) == ["a.b=1", "launcher=spawn", "launcher.group_size=2"]
    assert apply_fix(["a.b=1", "c=2"], "x. Fix: drop a.b, or c") == ["c=2"]
