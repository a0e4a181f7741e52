"""``dipaco-infer``: routed inference over a finished run (route | generate | score | export).

    dipaco-infer route    RUN_DIR (--text T [T ...] | --file F.jsonl) [--top-k K]
    dipaco-infer generate RUN_DIR --prompt P [--max-new-tokens N] [--temperature T] [--top-k K]
                          [--seed S] [--reroute-every W] [--no-kv-cache] [--json]
    dipaco-infer score    RUN_DIR (--file F.jsonl | --validation) [--reroute-every W] [--long] [--batch-size B] [--out F]
    dipaco-infer export   RUN_DIR (--path P | --all) --out DIR [--format dipaco|hf]

The rules (checkpoint check, path-at-a-time loading, short prompts, re-routing, long
contexts) are documented once, in :mod:`dipaco.inference`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from dipaco.config import DataConfig
from dipaco.data.cleaning import Cleaner
from dipaco.data.readers import iter_json_lines
from dipaco.cli.errors import fail, report_user_errors
from dipaco.inference import ExportError, InferenceRun, export_path, export_path_hf, export_routed_hf, parse_path
from dipaco.inference.export import DIPACO_EXPORT_FILES, check_export_target
from dipaco.inference.export_hf import HF_EXPORT_FILES
from dipaco.run.owned import check_owned, write_owned_file
from dipaco.run.path_guard import check_target
from dipaco.job.prepare import validation_ids
from dipaco.run.run_dir import RunDirError

_COMMON_EPILOG = (
    "The newest checkpoint is used; every file in its manifest is hash-checked first and a "
    "mismatch is refused, naming the file (--fast-verify: hash only the module files read). "
    "Weights are read with safetensors only.")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every dipaco error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (see {self.prog} --help)")


# Every numeric argument has a domain, as every config key does (dipaco/config/domains.py): an
# upper bound where a larger value only costs time or memory, checked before any work.
_HUGE = 2**20


def _int_in(name: str, lo: int, hi: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must lie in [{lo}, {hi}], got {v}")
        return v
    return parse


def _positive(name: str, hi: int = _HUGE):
    return _int_in(name, 1, hi)


def _non_negative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 <= v <= 100:  # nan and inf fail too: inf would sample uniformly, silently
        raise argparse.ArgumentTypeError(f"must lie in [0, 100], got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The ``dipaco-infer`` argument parser (one subcommand per verb)."""
    p = _Parser(prog="dipaco-infer", description="Routed inference over a finished dipaco-train run: "
                "each document is routed to one path and only that path's modules are loaded.")
    sub = p.add_subparsers(dest="command", metavar="{route,generate,score,export}", parser_class=_Parser)
    sub.required = True

    def common(sp: argparse.ArgumentParser, weights: bool = True) -> None:
        sp.add_argument("run_dir", metavar="RUN_DIR", help="a finished dipaco-train run directory")
        if weights:
            sp.add_argument("--checkpoint", default=None, metavar="ROUND",
                            help="round number, round_NNNNNN name or path (default: newest)")
            sp.add_argument("--fast-verify", action="store_true",
                            help="hash only the module files read, not the whole checkpoint")
            sp.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                            help="where the path models run (default: the run's trainer.device; auto = CUDA if present)")

    def inputs(sp: argparse.ArgumentParser, allow_text: bool) -> None:
        g = sp.add_mutually_exclusive_group(required=True)
        if allow_text:
            g.add_argument("--text", nargs="+", metavar="T", help="documents given inline")
        else:
            g.add_argument("--validation", action="store_true",
                           help="the run's own validation documents (as its evaluation scored them)")
            g.add_argument("--split", choices=("validation", "test"), default=None,
                           help="the documents the run's evaluation would score on this split of its corpus "
                                "(e.g. test, for a run evaluated on validation)")
        g.add_argument("--file", metavar="F.jsonl", help="one JSON object per line")
        sp.add_argument("--text-field", default="text", help="field holding the text in --file (default: text); "
                        "malformed lines are skipped and counted on stderr")

    r = sub.add_parser("route", help="which path each document goes to", epilog=(
        "Prints one JSON line per document: path_id, path (module index per level), modules. "
        "A document shorter than the routing prefix is routed on the tokens it has; an empty "
        "one goes to the router's fallback path (largest training shard) and says so."))
    common(r, weights=False)
    inputs(r, allow_text=True)
    r.add_argument("--top-k", type=_positive("--top-k"), default=None, metavar="K",
                   help="also list the K best paths with their routing costs (lower is better)")

    g = sub.add_parser("generate", help="continue a prompt with its path", epilog=(
        "The prompt's first prefix tokens choose the path (a prompt shorter than the routing "
        "prefix is routed on the tokens it has: the router's documented fallback); only that "
        "path's modules are loaded. Text streams to stdout; the path sequence goes to stderr "
        "(or a final JSON line with --json). With --reroute-every W, token j is generated by "
        "the path of window j//W, chosen as router.reroute_windows does (window 0 by the first "
        "prefix tokens, window j by the prefix tokens before it); a new path is loaded and its "
        "KV cache rebuilt when it changes (a prompt shorter than the prefix picks window 0's path "
        "from the prompt alone). The model sees at most the last max_seq_len tokens. "
        + _COMMON_EPILOG))
    common(g)
    g.add_argument("--prompt", required=True, help="the text to continue (must not be empty)")
    g.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=64, metavar="N",
                   help="tokens to generate at most (default 64; stops early at end-of-text)")
    g.add_argument("--temperature", type=_non_negative_float, default=0.8, metavar="T",
                   help="sampling temperature; 0 is greedy (default 0.8)")
    g.add_argument("--top-k", type=_positive("--top-k"), default=None, metavar="K",
                   help="sample among the K likeliest tokens only")
    g.add_argument("--seed", type=_int_in("--seed", 0, 2**32 - 1), default=0, metavar="S",
                   help="sampling seed (default 0)")
    g.add_argument("--reroute-every", type=_positive("--reroute-every"), default=None, metavar="W",
                   help="re-route every W tokens")
    g.add_argument("--no-kv-cache", action="store_true", help="re-run the whole context each step (slow)")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after the end-of-text token")
    g.add_argument("--json", action="store_true", help="end with one JSON line: text, tokens, paths")

    s = sub.add_parser("score", help="routed perplexity of documents", epilog=(
        "Same rule as the job's routed evaluation (so the run's validation documents give "
        "summary.json's routed_ppl): documents are cut to trainer.seq_len+1 tokens, the "
        "routing prefix carries no loss, documents with nothing after it are skipped and "
        "counted. With --long, the long protocol (summary.json's routed_ppl_long): whole "
        "documents in windows of --seq-len (default trainer.eval_seq_len or trainer.seq_len). "
        "Prints JSON with ppl, loss, num_tokens, per_path. " + _COMMON_EPILOG))
    common(s)
    inputs(s, allow_text=False)
    s.add_argument("--reroute-every", type=_positive("--reroute-every"), default=None, metavar="W",
                   help="score token j with the path of window j//W")
    s.add_argument("--batch-size", type=_positive("--batch-size", 2**16), default=None, metavar="B",
                   help="documents per forward (default: trainer.eval_batch_size)")
    s.add_argument("--seq-len", type=_positive("--seq-len"), default=None, metavar="L",
                   help="tokens scored per document, per window with --long (default: trainer.seq_len)")
    s.add_argument("--long", action="store_true", help="score whole documents in windows (docs/evaluation.md)")
    s.add_argument("--dense", action="store_true",
                   help="also score the run's same-size dense baseline on the same documents: "
                        "adds dense_ppl and ratio_vs_dense")
    s.add_argument("--out", default=None, metavar="F", help="write the JSON here instead of stdout")

    e = sub.add_parser("export", help="write one path as a standalone model directory", epilog=(
        "Writes model.safetensors (keys <module_id>/<param>), config.json (model config, path, "
        "module ids, source run), tokenizer.json and manifest.json (sha256 of each). Load it "
        "with dipaco.inference.load_exported_path(DIR) — no router needed. " + _COMMON_EPILOG))
    common(e)
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
    return p


# --------------------------------------------------------------------------- input


def read_jsonl(path: str, text_field: str) -> tuple[list[str], int]:
    """Texts of a jsonl file and the lines skipped, by the training readers' rules: a regular
    file only (a FIFO never blocks), and each bad line costs itself only, counted by reason."""
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a regular file"
        fail(f"--file {path} {what} (need a JSON-lines file: one JSON object per line)")
    records: dict[str, int] = {}
    cleaner = Cleaner(DataConfig(min_doc_chars=0, max_doc_chars=0), text_field, None, None)  # any length, never cut
    texts = [t for _, rec in iter_json_lines(path, path, records)
             if (t := cleaner.text_of(rec, truncated=False)) is not None]
    records.pop("blank_line", None)  # an empty line is not a document, nor a bad one
    reasons = {k: records.get(k, 0) + cleaner.skipped.get(k, 0) for k in {*records, *cleaner.skipped}}
    skipped = sum(reasons.values())
    if skipped:
        why = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()))
        print(f"dipaco: skipped {skipped} line(s) of {path}: {why} (text field {text_field!r})", file=sys.stderr)
    if not texts:
        fail(f"{path} has no usable document (need one JSON object per line with a string "
             f"field {text_field!r}; set --text-field)")
    return texts, skipped


def _texts(args: argparse.Namespace) -> tuple[list[str], int]:
    if getattr(args, "text", None):
        return list(args.text), 0
    return read_jsonl(args.file, args.text_field)


def _open(args: argparse.Namespace, need_weights: bool = True):
    return InferenceRun.open(args.run_dir, checkpoint=getattr(args, "checkpoint", None),
                             verify="read" if getattr(args, "fast_verify", False) else "all",
                             need_weights=need_weights, device=getattr(args, "device", None))


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- commands


def cmd_route(args: argparse.Namespace) -> None:
    run = _open(args, need_weights=False)
    texts, _ = _texts(args)
    if args.top_k is not None and args.top_k > run.num_paths:
        fail(f"--top-k {args.top_k} exceeds the number of paths ({run.num_paths})")
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
        _emit(json.dumps(rec))


class _TextStream:
    """Writes decoded text as tokens arrive; holds back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Any, out: Any) -> None:
        self.tok, self.out = tokenizer, out
        self.ids: list[int] = []
        self.written = 0

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # a byte-level token split a character: wait for the rest
            return
        self.out.write(text[self.written:])
        self.out.flush()
        self.written = len(text)

    def close(self) -> str:
        text = self.tok.decode(self.ids)
        self.out.write(text[self.written:] + "\n")
        self.out.flush()
        return text


def cmd_generate(args: argparse.Namespace) -> None:
    if not args.prompt.strip():
        fail("--prompt is empty: give some text to continue")
    run = _open(args)
    prompt = run.encode(args.prompt)
    if not prompt:
        fail("--prompt encodes to no tokens: give some text to continue")
    if len(prompt) < run.prefix_tokens:
        print(f"dipaco: note: the prompt has {len(prompt)} tokens, fewer than the routing prefix "
              f"({run.prefix_tokens}); routing on those {len(prompt)}", file=sys.stderr)
    stream = _TextStream(run.tokenizer, sys.stdout)
    gen = run.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, reroute_every=args.reroute_every,
                       use_kv_cache=not args.no_kv_cache, stop_at_eos=not args.ignore_eos,
                       on_token=stream)
    text = stream.close()
    used = [p for _, p in gen.switches]
    info = {"path_sequence": gen.window_paths, "paths_used": used,
            "switches": [{"position": pos, **run.path_info(p)} for pos, p in gen.switches],
            "reroute_every": args.reroute_every, "prompt_tokens": len(prompt),
            "new_tokens": len(gen.tokens), "stopped_at_eos": gen.stopped_at_eos}
    if args.json:
        _emit(json.dumps({"text": text, "tokens": gen.tokens, "prompt_ids": prompt, **info}))
    elif args.reroute_every is None:
        p = run.path_info(used[0] if used else gen.window_paths[0])
        print(f"dipaco: path {p['path_id']} {tuple(p['path'])} modules {p['modules']}", file=sys.stderr)
    else:
        steps = ", ".join(f"{p} {run.router.path_tuple(p)} from token {pos}" for pos, p in gen.switches)
        print(f"dipaco: re-routed every {args.reroute_every} tokens; paths used: {steps or 'none'}; "
              f"path of each window: {gen.window_paths}", file=sys.stderr)


def _score_out(path: str) -> Path:
    """``score --out`` checked before any work: not in a run directory
    (dipaco/run/path_guard.py), and a file only dipaco wrote there may be replaced
    (dipaco/run/owned.py)."""
    given = Path(path).expanduser()
    if given.is_dir():
        raise RunDirError(f"score --out {path} is a directory; name a file (e.g. {Path(path) / 'score.json'})")
    check_owned(given.parent, [given.name], "score --out", replace=True)  # a link in the way: refused here
    check_target(path, "score --out", fix="choose a --out outside every run directory")
    return given.parent.resolve() / given.name


def cmd_score(args: argparse.Namespace) -> None:
    out = _score_out(args.out) if args.out else None
    run = _open(args)
    from_corpus = args.validation or args.split is not None
    texts, skipped = ([], 0) if from_corpus else _texts(args)
    if args.seq_len is not None and args.seq_len > run.cfg.model.max_seq_len:
        fail(f"--seq-len {args.seq_len} exceeds model.max_seq_len {run.cfg.model.max_seq_len}")
    if from_corpus:
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
        write_owned_file(out, json.dumps(report, indent=2, sort_keys=True) + "\n", "score --out")
        print(f"dipaco: wrote {args.out}", file=sys.stderr)
    else:
        _emit(json.dumps(report, sort_keys=True))


def cmd_export(args: argparse.Namespace) -> None:
    if args.all and args.format != "hf":
        fail("--all writes the routed Hugging Face export: add --format hf (or export one path with --path P)")
    names = (DIPACO_EXPORT_FILES if args.format == "dipaco" else HF_EXPORT_FILES)
    check_export_target(Path(args.out).expanduser().resolve(), args.force, names)  # before any work
    run = _open(args)
    if args.all:
        try:
            out = export_routed_hf(run, args.out, overwrite=args.force)
        except ExportError as e:
            fail(f"cannot export the routed model as Llama checkpoints: {e}")
        _emit(json.dumps({"out": str(out), "num_paths": run.num_paths, "checkpoint": str(run.checkpoint)}))
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
    _emit(json.dumps({"out": str(out), **run.path_info(path_id), "checkpoint": str(run.checkpoint)}))


_COMMANDS = {"route": cmd_route, "generate": cmd_generate, "score": cmd_score, "export": cmd_export}


@report_user_errors
def _dispatch(args: argparse.Namespace) -> None:
    try:
        _COMMANDS[args.command](args)
    except BrokenPipeError:  # `dipaco-infer generate ... | head`: the reader left; not an error
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except FileNotFoundError:
        raise  # a user error already (report_user_errors)
    except OSError as e:  # an --out that exists or cannot be written, a directory for --file, ...
        fail(f"{e}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    _dispatch(args)


if __name__ == "__main__":
    main(sys.argv[1:])
