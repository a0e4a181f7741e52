"""The golden-trajectory runs: a [2, 2] grid trained for 3 rounds, seven ways.

``tests/golden/trajectory.json`` holds what these runs produced when it was written (per
path and round: the inner loss; per module after the last round: the global weights'
sum, L2 norm and a fixed sample of values; for the scenarios added with the α and
streaming ones, also per module and round Σα and the pseudo-gradient's norm).
``tests/test_golden.py`` re-runs them and compares. It guards refactors of the round:
the numbers may only change when the arithmetic is meant to change. The file only
grows: ``--rewrite`` runs the scenarios it lacks and adds them, leaving every recorded
entry byte for byte as it was; an entry is replaced only when named with ``--replace``
(the arithmetic was meant to change, and the commit says why)::

    .venv/bin/python tests/golden_run.py --rewrite               # adds missing scenarios
    .venv/bin/python tests/golden_run.py --replace streaming_mix # re-records one on purpose

The run directory is built by hand from a seeded synthetic token corpus (no corpus
reader, tokenizer training or router), so changes to the data pipeline cannot move it:
only the rounds loop, the path learner, the per-module sync and the outer step can.

Scenarios:

* ``sync_local``: the local backend (one process plays both worker groups), codec none.
* ``sync_gloo``: the same run on 2 gloo ranks (spawn launcher), one worker group each.
* ``int8_ef``: the local backend with ``diloco.codec=int8`` and error feedback.
* ``decoupled_full_quorum``: decoupled mode (learner and synchroniser processes meeting
  through a store) forced to full quorum with no staleness: every module steps once per
  phase over every path that holds it, as sync mode does.
* ``alpha_shard_size``: the local backend on the *skewed* corpus (four shards of different
  sizes) with ``diloco.alpha=shard_size``: each module's average weighs its paths
  unequally. In the scenarios above every path trains the same tokens, α is uniform and
  a wrong weighting cancels in ΣαΔ/Σα.
* ``streaming_mix``: streaming DiLoCo on the skewed corpus with α = shard size, τ = 1,
  3 fragments (launches after steps 1, 2, 3 of H = 4, landing one step later) and mix
  0.3: the default 0.5 makes ``keep`` and ``1 − keep`` the same number.
* ``streaming_int4_ef``: the same streaming run with ``diloco.codec=int4`` and error feedback.

These three run in one process (local backend) like ``sync_local``: a gloo replay of
streaming is already pinned to its local run by ``tests/test_streaming.py``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dipaco.run.checkpoint import load_state
from dipaco.config import Config, compose_config
from dipaco.data import Tokenizer
from dipaco.run.fingerprint import Fingerprints
from dipaco.run.run_dir import RunDir
from router.shards import write_shards
from router.tokens import TokenDocs

GOLDEN = Path(__file__).parent / "golden" / "trajectory.json"
ROUNDS = 3
SAMPLE = 16  # values sampled per module tensor (evenly spaced)

BASE = [
    "experiment=smoke",
    "grid=2x2",
    "model.vocab_size=300",  # > the 257 byte-level tokens of the BPE below; the corpus uses ids < 256
    f"trainer.rounds={ROUNDS}",
    "trainer.dense_baseline=false",
    "trainer.warmup_fraction=0",
    "trainer.threads=1",  # ops in one order whatever the host's core count
    "diloco.inner_steps=4",
]

STREAM = ["launcher=local", "launcher.nproc=2", "diloco.alpha=shard_size", "diloco.streaming=true",
          "diloco.streaming_delay=1", "diloco.streaming_fragments=3", "diloco.streaming_mix=0.3"]

SCENARIOS: dict[str, list[str]] = {
    "sync_local": ["launcher=local", "launcher.nproc=2"],
    "sync_gloo": ["launcher=spawn", "launcher.nproc=2", "launcher.timeout_s=120"],
    "int8_ef": ["launcher=local", "launcher.nproc=2", "diloco.codec=int8", "diloco.error_feedback=true"],
    "decoupled_full_quorum": [
        "launcher=local", "launcher.nproc=2", "diloco.mode=decoupled",
        "diloco.decoupled.learners=4", "diloco.decoupled.quorum=1.0", "diloco.decoupled.max_staleness=0",
        "diloco.decoupled.momentum_every=1", "diloco.decoupled.dynamic_steps=false",
        "diloco.decoupled.grace_init_s=600", "diloco.decoupled.grace_min_s=600",
        "diloco.decoupled.grace_max_s=600", "diloco.decoupled.pull_wait_s=600",
        "diloco.decoupled.pull_wait_fraction=null", "diloco.decoupled.timeout_s=300",
    ],
    "alpha_shard_size": ["launcher=local", "launcher.nproc=2", "diloco.alpha=shard_size"],
    "streaming_mix": STREAM,
    "streaming_int4_ef": STREAM + ["diloco.codec=int4", "diloco.error_feedback=true"],
}

#: the corpus each scenario trains on (default: ``even``, see :func:`synthetic_docs`)
CORPUS = {"alpha_shard_size": "skewed", "streaming_mix": "skewed", "streaming_int4_ef": "skewed"}


def synthetic_docs(num_docs: int = 160, seed: int = 0, corpus: str = "even") -> tuple[TokenDocs, list[list[int]]]:
    """Token documents from four seeded Markov chains over byte ids, one per path.

    Each chain favours its own band of ids, so the four shards differ the way routed
    shards do. ``even``: a document goes to its own path and, every third document, to
    the next one too (top-2 overlap, so shards share documents as they do after routing).
    ``skewed``: the same documents; document ``i`` of chain ``k`` also goes to path
    ``k + 1`` when ``k + 2`` divides ``i``, so the shards hold about 48, 80, 53 and 40
    documents and α = shard size differs on every path.
    """
    rng = np.random.default_rng(seed)
    chains = []
    for k in range(4):
        logits = rng.normal(size=(256, 256))
        logits[:, 64 * k : 64 * (k + 1)] += 3.0
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        chains.append(np.cumsum(probs / probs.sum(axis=1, keepdims=True), axis=1))
    docs, assignments = [], []
    for i in range(num_docs):
        k = i % 4
        n = int(rng.integers(80, 200))
        tok = [int(rng.integers(0, 256))]
        for u in rng.random(n - 1):
            tok.append(int(min(255, np.searchsorted(chains[k][tok[-1]], u))))
        docs.append(tok)
        extra = i % 3 == 0 if corpus == "even" else i % (k + 2) == 0
        assignments.append([k, (k + 1) % 4] if extra else [k])
    return TokenDocs.from_arrays(docs), assignments


def build_run(root: Path, corpus: str = "even") -> RunDir:
    """A run directory holding what the rounds read: the tokenizer (its end-of-text id)
    and the shards of the synthetic corpus, recorded in ``fingerprints.json``."""
    run = RunDir.at(root)
    run.root.mkdir(parents=True, exist_ok=True)
    # Recorded through the record preparation writes (Fingerprints.record: inputs and each
    # file's sha256), not by hand. Preparation itself (dipaco/job) is not used: it would
    # read a corpus, train the BPE and route, and then the data pipeline could move these
    # trajectories. The inputs recorded say what the artefacts were really made from.
    fp = Fingerprints(run, compose_config(BASE, run.root), log=lambda _msg: None)
    made_from = {"given": f"tests/golden_run.py synthetic_docs(corpus={corpus!r})"}
    Tokenizer.train(["golden trajectory " * 8], vocab_size=257).save(str(run.tokenizer))
    fp.record("tokenizer", fp.want("tokenizer", **made_from))
    docs, assignments = synthetic_docs(corpus=corpus)
    write_shards(docs, assignments, 4, run.shards)
    fp.record("shards", fp.want("shards", **made_from))
    return run


def scenario_config(name: str, run: RunDir) -> Config:
    """The config of one scenario, rooted at ``run``."""
    return compose_config(BASE + SCENARIOS[name], run.root)


def run_rounds(cfg: Config, run: RunDir) -> None:
    """The rounds of ``cfg`` on ``run`` through the job's own entry points."""
    from dipaco.decoupled.run import run_decoupled
    from dipaco.runtime.launch import launch
    from dipaco.rounds import run_rank

    if cfg.diloco.mode == "decoupled":
        run_decoupled(cfg, run)
    else:
        launch(run_rank, cfg, run)


def _tensor_summary(t: torch.Tensor) -> dict[str, Any]:
    flat = t.detach().reshape(-1).to(torch.float64)
    idx = torch.linspace(0, flat.numel() - 1, min(SAMPLE, flat.numel())).round().long()
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"shape": list(t.shape), "sum": float(flat.sum()), "norm": float(flat.norm()),
            "sample": [float(x) for x in flat[idx]],
            # informational only: bit equality across CPUs is not a contract
            "sha256": hashlib.sha256(raw).hexdigest()}


def trajectory(run: RunDir) -> dict[str, Any]:
    """Per path and round the inner loss; per module the final global weights' summary;
    per module and round Σα (``alpha``) and ‖ΣαΔ/Σα‖ (``pseudo_grad_norm``), as logged."""
    losses: dict[str, list[float]] = {}
    alpha: dict[str, list[float]] = {}
    norms: dict[str, list[float]] = {}
    for line in run.metrics.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        for p, v in sorted(rec["paths"].items(), key=lambda kv: int(kv[0])):
            losses.setdefault(p, []).append(float(v["loss"]))
        for m, v in sorted(rec["modules"].items()):
            alpha.setdefault(m, []).append(float(v["alpha_sum"]))
            norms.setdefault(m, []).append(float(v["pseudo_grad_norm"]))
    ckpt = run.checkpoints / f"round_{ROUNDS:06d}" / "modules"
    weights = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        state = load_state(f)
        weights[f.stem] = {k: _tensor_summary(v) for k, v in sorted(state.items())}
    return {"losses": losses, "weights": weights, "alpha": alpha, "pseudo_grad_norm": norms}


def scenario_codec(name: str) -> str:
    """``diloco.codec`` of a scenario (``none`` for any other name)."""
    keys = dict(o.split("=", 1) for o in BASE + SCENARIOS.get(name, []))
    return keys.get("diloco.codec", "none")


def run_scenario(name: str, workdir: Path) -> dict[str, Any]:
    """Build a fresh run directory under ``workdir``, train the scenario, summarise it."""
    run = build_run(workdir / name, CORPUS.get(name, "even"))
    run_rounds(scenario_config(name, run), run)
    return trajectory(run)


def rewrite(workdir: Path, names: list[str] | None = None, replace: bool = False,
            log: Callable[[str], None] = print) -> list[str]:
    """Run the scenarios the golden file lacks (of ``names``, default all) and add them;
    with ``replace``, re-run the named ones and replace their entries. Every other entry
    is written back exactly as read. The only writer of the file; returns what it ran."""
    out = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    unknown = sorted(set(names or []) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"golden: no scenario {unknown}; known: {sorted(SCENARIOS)}")
    if replace and not names:
        raise SystemExit("golden: --replace re-records the scenarios it names, and only those")
    todo = list(names) if replace else [n for n in (names or list(SCENARIOS)) if n not in out]
    for name in todo:
        log(f"golden: running {name}")
        out[name] = run_scenario(name, workdir)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    log(f"golden: wrote {GOLDEN} ({', '.join(todo) or 'nothing new'})")
    return todo


if __name__ == "__main__":
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--rewrite", action="store_true", help="run the scenarios the golden file lacks and add them")
    mode.add_argument("--replace", action="store_true", help="re-record the named scenarios (on purpose)")
    ap.add_argument("names", nargs="*", help="scenarios (default with --rewrite: every one the file lacks)")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as d:
        rewrite(Path(d), a.names or None, replace=a.replace)
