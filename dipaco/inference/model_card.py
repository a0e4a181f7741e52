"""What an export carries besides weights: where it came from and how to use it.

Every export (``dipaco-infer export``, every format) holds ``provenance.json``: the run's
``provenance.jsonl`` records (what trained it, per launch) and one record of the export
itself. A Hugging Face export (``--format hf``, and ``--all``) also holds the training
config (``training_config.yaml``, the run's ``config.yaml``; not named ``config.yaml`` so
the export is never mistaken for a run directory) and a model card, ``README.md``: what
the path is, its modules and routing, the training config, the data, the perplexity the
run measured, how to load it and the routed loader.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

from dipaco.storage.atomic import write_json
from dipaco.run.provenance import collect, one_line, read

PROVENANCE_FILE = "provenance.json"
TRAINING_CONFIG = "training_config.yaml"
MODEL_CARD = "README.md"


def write_provenance(run: Any, out: Path) -> None:
    """``out/provenance.json``: the run's launches and this export."""
    write_json(out / PROVENANCE_FILE, {"run": read(run.run.root), "export": collect("export"),
                                       "source": {"run_dir": str(run.run.root), "checkpoint": run.checkpoint.name}})


def write_training_config(run: Any, staging: Path) -> None:
    """``staging/training_config.yaml`` (an export's staging folder): the run's resolved
    config as it was trained."""
    (staging / TRAINING_CONFIG).write_text(run.run.config.read_text(encoding="utf-8"), encoding="utf-8")


def _summary(run: Any) -> dict:
    try:
        got = json.loads(run.run.summary.read_text(encoding="utf-8"))
        return got if isinstance(got, dict) else {}
    except (OSError, ValueError):
        return {}


def _num(v: Any) -> Optional[str]:
    return f"{v:.4g}" if isinstance(v, (int, float)) and math.isfinite(v) else None


def _perplexity_lines(summary: dict, path_ids: Sequence[int]) -> list[str]:
    split = summary.get("eval_split", "validation")
    lines = []
    for key, label in (("routed_ppl", "routed (every document on its routed path)"),
                       ("dense_ppl", "same-size dense baseline"), ("ratio_vs_dense", "routed / dense")):
        if (v := _num(summary.get(key))) is not None:  # a run without the baseline has no dense rows
            lines.append(f"- {label}: {v}")
    per_path = summary.get("per_path") or {}
    for p in path_ids:
        rec = per_path.get(str(p)) or {}
        if (v := _num(rec.get("ppl"))) is not None:
            lines.append(f"- path {p} on the {rec.get('num_documents', '?')} {split} documents routed to it: {v}")
    if not lines:
        return ["The run recorded no perplexity (no summary.json: it was exported before it finished)."]
    return [f"Measured by the run on its {split} split (summary.json):", "", *lines]


def model_card(run: Any, path_ids: Sequence[int], routed: bool) -> str:
    """The ``README.md`` of a Hugging Face export of ``path_ids`` (all of them: ``routed``)."""
    cfg = run.cfg
    grid = run.new_grid()
    levels = list(cfg.grid.levels)
    summary = _summary(run)
    m = cfg.model
    if routed:
        title = f"# DiPaCo routed model: {run.num_paths} paths of a {levels} grid"
        what = (f"Every path of a DiPaCo run, each a standalone `LlamaForCausalLM` in `path_NNN/`, with the "
                "run's router (`router/`) that picks the path of a document from its first tokens.")
    else:
        p = path_ids[0]
        title = f"# DiPaCo path {p} {tuple(grid.path_of(p))} of a {levels} grid"
        what = (f"Path {p} of a DiPaCo run ({run.num_paths} paths) as a standalone `LlamaForCausalLM`. A "
                "path is one module per level of the grid, composed into one model; it was trained on the "
                "documents the router sends to it, so it is best on text like them.")
    modules = [f"- path {p} {tuple(grid.path_of(p))}: modules {', '.join(grid.module_ids_of_path(p))}"
               for p in path_ids]
    prov = read(run.run.root)
    lines = [
        title, "", what, "",
        "## Modules and routing", "",
        f"Grid {levels} (modules per level), {len(levels) * m.layers_per_level} blocks per path, "
        f"d_model {m.d_model}, {m.n_heads} heads, vocabulary {m.vocab_size}, context {m.max_seq_len} tokens.", "",
        *modules, "",
        f"Routing: `router.method={cfg.router.method}` on the first {run.prefix_tokens} tokens of a "
        "document (`dipaco-infer route` and `load_routed` apply the same rule).", "",
        "## Training", "",
        f"The full resolved config is `{TRAINING_CONFIG}`. Data: `data.source={cfg.data.source}`"
        + (f" from `{cfg.data.path}`" if getattr(cfg.data, "path", None) else "") + f", seed {cfg.seed}, "
        f"{cfg.trainer.rounds} rounds of {cfg.diloco.inner_steps} inner steps, checkpoint `{run.checkpoint.name}`.", "",
        "## Perplexity", "", *_perplexity_lines(summary, path_ids), "",
        "## How to load it", "",
    ]
    if routed:
        lines += ["```python", "from dipaco.inference import load_routed", "",
                  "routed = load_routed(\"THIS_FOLDER\")          # checks every file against manifest.json",
                  "path, text = routed.generate(\"def main():\", max_new_tokens=32)",
                  "path, logits = routed.logits(\"def main():\")", "```", "",
                  "One path alone: `transformers.LlamaForCausalLM.from_pretrained(\"THIS_FOLDER/path_003\")`; "
                  "route a document to its path first (the router is not part of the Llama checkpoint)."]
    else:
        lines += ["```python", "from transformers import AutoTokenizer, LlamaForCausalLM", "",
                  "model = LlamaForCausalLM.from_pretrained(\"THIS_FOLDER\")",
                  "tokenizer = AutoTokenizer.from_pretrained(\"THIS_FOLDER\")", "```", "",
                  "This is one path: for documents the router sends elsewhere another path is better. "
                  "Every path with its router: `dipaco-infer export RUN --format hf --all --out DIR`, then "
                  "`dipaco.inference.load_routed(DIR)`."]
    lines += ["", "## Provenance", "", "What trained the run (one line per launch; `provenance.json` holds all):", ""]
    lines += [f"- {one_line(r)}" for r in prov] or ["- not recorded (the run predates provenance records)"]
    return "\n".join(lines) + "\n"


def write_hf_extras(run: Any, staging: Path, path_ids: Sequence[int], routed: bool) -> None:
    """The model card, training config and provenance of a Hugging Face export, into its
    staging folder (published whole by dipaco/run/owned.py)."""
    write_provenance(run, staging)
    write_training_config(run, staging)
    (staging / MODEL_CARD).write_text(model_card(run, path_ids, routed), encoding="utf-8")


__all__ = ["MODEL_CARD", "PROVENANCE_FILE", "TRAINING_CONFIG", "model_card", "write_hf_extras",
           "write_provenance", "write_training_config"]
