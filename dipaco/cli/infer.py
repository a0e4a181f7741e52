"""``dipaco-infer``: routed inference over a finished run (route | generate | score | export | eval).

    dipaco-infer route    RUN_DIR (--text T [T ...] | --file F.jsonl) [--top-k K]
    dipaco-infer generate RUN_DIR (--prompt P [--json] | --file F.jsonl [--out F [--resume]] [--batch-size B])
                          [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                          [--reroute-every W] [--max-loaded-paths N] [--no-kv-cache]
    dipaco-infer score    RUN_DIR (--file F.jsonl | --validation) [--reroute-every W] [--long] [--batch-size B] [--out F]
    dipaco-infer export   RUN_DIR (--path P | --all) --out DIR [--format dipaco|hf]
    dipaco-infer eval     RUN_DIR --tasks T[,T...] --include-path DIR [--limit N] [--num-fewshot K] [--dense] [--out F]

The rules (checkpoint check, path-at-a-time loading, short prompts, re-routing, long
contexts) are documented once, in :mod:`dipaco.inference`. This module is the dispatcher:
``VERBS`` maps each verb to (add its subparser, run it); a verb with its own module
(``infer_generate.py``) is one line there. Shared arguments live in ``infer_args.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dipaco.cli import infer_eval, infer_generate
from dipaco.cli.errors import entry_point, fail, known_error, report_user_errors
from dipaco.cli.infer_args import (COMMON_EPILOG, FILE_ONLY, Parser, add_inputs, add_run_args, emit, mode_flags,
                                   open_run, out_file, positive, read_jsonl, texts_of)
from dipaco.inference import ExportError, export_path, export_path_hf, export_routed_hf, parse_path
from dipaco.inference.export import DIPACO_EXPORT_FILES, check_export_target
from dipaco.inference.export_hf import HF_EXPORT_FILES
from dipaco.run.owned import write_owned_file
from dipaco.storage.strict_json import dumps_strict

__all__ = ["main", "build_parser", "read_jsonl", "VERBS"]


# --------------------------------------------------------------------------- parsers

def _add_route(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser("route", help="which path each document goes to", epilog=(
        "Prints one JSON line per document: path_id, path (module index per level), modules. "
        "A document shorter than the routing prefix is routed on the tokens it has; an empty "
        "one goes to the router's fallback path (largest training shard) and says so."))
    add_run_args(r, weights=False)
    add_inputs(r, allow_text=True)
    r.add_argument("--top-k", type=positive("--top-k"), default=None, metavar="K",
                   help="also list the K best paths with their routing costs (lower is better)")
    return r


def _add_score(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser("score", help="routed perplexity of documents", epilog=(
        "Same rule as the job's routed evaluation (so the run's validation documents give "
        "summary.json's routed_ppl): documents are cut to trainer.seq_len+1 tokens, the "
        "routing prefix carries no loss, documents with nothing after it are skipped and "
        "counted. With --long, the long protocol (summary.json's routed_ppl_long): whole "
        "documents in windows of --seq-len (default trainer.eval_seq_len or trainer.seq_len). "
        "Prints JSON with ppl, loss, num_tokens, per_path. " + COMMON_EPILOG))
    add_run_args(s)
    add_inputs(s, allow_text=False)
    s.add_argument("--reroute-every", type=positive("--reroute-every"), default=None, metavar="W",
                   help="score token j with the path of window j//W")
    s.add_argument("--batch-size", type=positive("--batch-size", 2**16), default=None, metavar="B",
                   help="documents per forward (default: trainer.eval_batch_size)")
    s.add_argument("--seq-len", type=positive("--seq-len"), default=None, metavar="L",
                   help="tokens scored per document, per window with --long (default: trainer.seq_len)")
    s.add_argument("--long", action="store_true", help="score whole documents in windows (docs/evaluation.md)")
    s.add_argument("--dense", action="store_true",
                   help="also score the run's same-size dense baseline on the same documents: "
                        "adds dense_ppl and ratio_vs_dense")
    s.add_argument("--out", default=None, metavar="F", help="write the JSON here instead of stdout")
    s.add_argument("--force", action="store_true", help="with --out: replace an earlier score --out report there "
                   "(never a file dipaco did not write)")
    return s


def _add_export(sub: Any) -> argparse.ArgumentParser:
    e = sub.add_parser("export", help="write one path as a standalone model directory", epilog=(
        "Writes model.safetensors (keys <module_id>/<param>), config.json (model config, path, "
        "module ids, source run), tokenizer.json and manifest.json (sha256 of each). Load it "
        "with dipaco.inference.load_exported_path(DIR) — no router needed. " + COMMON_EPILOG))
    add_run_args(e)
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--path", metavar="P", help="path id (e.g. 9) or module index per level (e.g. 2,1)")
    which.add_argument("--all", action="store_true", help="with --format hf: every path as a Llama checkpoint plus "
                       "the router; dipaco.inference.load_routed(DIR) routes a prompt and runs its path")
    e.add_argument("--out", required=True, metavar="DIR", help="output directory (new or empty)")
    e.add_argument("--force", action="store_true",
                   help="replace an earlier export in --out (never a run directory or a folder it did not write)")
    e.add_argument("--format", choices=("dipaco", "hf"), default="dipaco",
                   help="dipaco (default): the layout above; hf: a Hugging Face Llama checkpoint "
                        "(config.json, model.safetensors, tokenizer files) for "
                        "transformers.LlamaForCausalLM.from_pretrained(DIR)")
    return e


# --------------------------------------------------------------------------- commands


def cmd_route(args: argparse.Namespace) -> None:
    mode_flags(args, {"--file": FILE_ONLY})
    run = open_run(args, need_weights=False)
    texts, _ = texts_of(args)
    if args.top_k is not None and args.top_k > run.num_paths:
        fail(f"--top-k {args.top_k} exceeds the number of paths ({run.num_paths}): use --top-k {run.num_paths}")
    docs = [run.encode(t) for t in texts]
    paths = run.router.route_batch(docs)
    if args.top_k:
        cand, costs = run.router.route_topk(docs, args.top_k)
    for i, (doc, p) in enumerate(zip(docs, paths)):
        rec: dict[str, Any] = {"index": i, **run.path_info(int(p)), "num_tokens": len(doc),
                               "routed_on_tokens": min(len(doc), run.prefix_tokens)}
        if not doc:
            rec["fallback"] = True  # no token to route on: the router's fallback path
        if args.top_k:
            rec["candidates"] = [{**run.path_info(int(c)), "cost": float(k)}
                                 for c, k in zip(cand[i], costs[i])]
        emit(dumps_strict(rec))


def cmd_score(args: argparse.Namespace) -> None:
    mode_flags(args, {"--file": FILE_ONLY})  # before any work: --text-field with --validation does nothing
    out = out_file(args, "score --out")
    run = open_run(args)
    from_corpus = args.validation or args.split is not None
    texts, skipped = ([], 0) if from_corpus else texts_of(args)
    if args.seq_len is not None and args.seq_len > run.cfg.model.max_seq_len:
        fail(f"--seq-len {args.seq_len} exceeds model.max_seq_len {run.cfg.model.max_seq_len}: "
             f"use --seq-len {run.cfg.model.max_seq_len}")
    if from_corpus:
        # imported here: the training job's data preparation loads ``datasets`` and the
        # corpus readers, which every other verb of this command does without
        from dipaco.job.prepare import validation_ids

        docs = validation_ids(run.cfg, run.run, split=args.split)
    else:
        docs = [run.encode(t) for t in texts]
    report = run.score(docs, reroute_every=args.reroute_every, batch_size=args.batch_size, seq_len=args.seq_len,
                       whole_documents=args.long)
    if args.dense:
        dense = run.score_dense(docs, batch_size=args.batch_size, seq_len=args.seq_len, whole_documents=args.long)
        report.update({"dense_ppl": dense["ppl"], "dense_loss": dense["loss"],
                       "ratio_vs_dense": report["ppl"] / dense["ppl"] if dense["num_tokens"] else None})
        for key, part in report.get("by_window", {}).items():  # --long: the same split for dense
            d = dense["by_window"][key]
            part.update({"dense_ppl": d["ppl"], "ratio_vs_dense": part["ppl"] / d["ppl"]})
    report.update({"skipped_malformed_lines": skipped, "num_input_documents": len(docs),
                   "checkpoint": str(run.checkpoint), "best_paths": run.best_paths, "run_dir": str(run.run.root)})
    if report["num_tokens"] == 0:
        print(f"dipaco: no document has a token after the {run.prefix_tokens}-token routing prefix; "
              "perplexity is undefined (nan)", file=sys.stderr)
    if out is not None:
        write_owned_file(out, dumps_strict(report, indent=2, sort_keys=True) + "\n", "score --out")
        print(f"dipaco: wrote {args.out}", file=sys.stderr)
    else:
        emit(dumps_strict(report, sort_keys=True))


def cmd_export(args: argparse.Namespace) -> None:
    if args.all and args.format != "hf":
        fail("--all writes the routed Hugging Face export: add --format hf (or export one path with --path P)")
    names = (DIPACO_EXPORT_FILES if args.format == "dipaco" else HF_EXPORT_FILES)
    check_export_target(Path(args.out).expanduser().resolve(), args.force, names)  # before any work
    run = open_run(args)
    if args.all:
        try:
            out = export_routed_hf(run, args.out, overwrite=args.force)
        except ExportError as e:
            fail(f"cannot export the routed model as Llama checkpoints: {e}")
        emit(dumps_strict({"out": str(out), "num_paths": run.num_paths, "checkpoint": str(run.checkpoint)}))
        return
    try:
        path_id = parse_path(args.path, run.new_grid())
    except ValueError as e:
        fail(str(e))
    if args.format == "hf":
        try:
            out = export_path_hf(run, path_id, args.out, overwrite=args.force)
        except ExportError as e:
            fail(f"cannot export path {path_id} as a Llama checkpoint: {e}")
    else:
        out = export_path(run, path_id, args.out, overwrite=args.force)
    emit(dumps_strict({"out": str(out), **run.path_info(path_id), "checkpoint": str(run.checkpoint)}))


# verb -> (add its subparser, run it): a new verb is its own module plus one line here
VERBS: dict[str, tuple[Callable[[Any], argparse.ArgumentParser], Callable[[argparse.Namespace], None]]] = {
    "route": (_add_route, cmd_route),
    "generate": (infer_generate.add_parser, infer_generate.run),
    "score": (_add_score, cmd_score),
    "export": (_add_export, cmd_export),
    "eval": (infer_eval.add_parser, infer_eval.run),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``dipaco-infer`` argument parser (one subcommand per verb of ``VERBS``)."""
    p = Parser(prog="dipaco-infer", description="Routed inference over a finished dipaco-train run: "
               "each document is routed to one path and only that path's modules are loaded.")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(VERBS) + "}", parser_class=Parser)
    sub.required = True
    for add, _ in VERBS.values():
        add(sub)
    return p


def left_behind(args: argparse.Namespace) -> str:
    """What ``args``' verb leaves when it stops early (Ctrl-C, a full disk) and how to go on:
    the error boundary's own words are a training run's (its last checkpoint), and no verb
    here writes one."""
    if args.command == "generate" and getattr(args, "file", None) and getattr(args, "out", None):
        return (f"the whole lines in {args.out} are kept and a torn last one is cut on resume: "
                "the same command with --resume continues it")
    if getattr(args, "out", None):  # score, eval and export write their --out whole or not at all
        return f"{args.out} is written whole or not at all, so nothing half-written is left; run the command again"
    return f"dipaco-infer {args.command} stopped (what it printed is whole lines); run the command again"


def interrupted(args: argparse.Namespace) -> str:
    """The one line for Ctrl-C (SIGINT) during ``args``' verb."""
    return f"interrupted: {left_behind(args)}"


@report_user_errors
def _dispatch(args: argparse.Namespace) -> None:
    try:
        VERBS[args.command][1](args)
    except KeyboardInterrupt:
        fail(interrupted(args), code=1)
    except BrokenPipeError:  # `dipaco-infer generate ... | head`: the reader left; not an error
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as e:  # a missing file, an --out that cannot be written, a full disk, ...
        # the boundary's one rule for an OSError (its hint, exit 1 for the environment), in this verb's words
        fail(*(known_error(e, kept=left_behind(args)) or (str(e), 2)))


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    _dispatch(args)


if __name__ == "__main__":
    main(sys.argv[1:])
