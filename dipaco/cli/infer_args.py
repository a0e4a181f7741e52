"""What every ``dipaco-infer`` verb shares: the one-line-error parser, numeric argument
domains, the run/input arguments, ``read_jsonl`` (the training readers' rules) and opening
the run. A verb module (``infer_generate.py``, ...) imports these; ``infer.py`` dispatches.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from dipaco.cli.errors import fail
from dipaco.config import DataConfig
from dipaco.data.cleaning import Cleaner
from dipaco.data.readers import iter_json_lines
from dipaco.inference import InferenceRun
from dipaco.run.owned import check_out_file

COMMON_EPILOG = (
    "The newest checkpoint is used; every file in its manifest is hash-checked first and a "
    "mismatch is refused, naming the file (--fast-verify: hash only the module files read). "
    "Weights are read with safetensors only.")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every dipaco error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (see {self.prog} --help)")


# Every numeric argument has a domain, as every config key does (dipaco/config/domains.py): an
# upper bound where a larger value only costs time or memory, checked before any work.
HUGE = 2**20


def int_in(name: str, lo: int, hi: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[lo, hi]``."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{name} must lie in [{lo}, {hi}], got {v}")
        return v
    return parse


def positive(name: str, hi: int = HUGE) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers in ``[1, hi]``."""
    return int_in(name, 1, hi)


def non_negative_float(s: str) -> float:
    """An argparse ``type``: a number in [0, 100]."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 <= v <= 100:  # nan and inf fail too: inf would sample uniformly, silently
        raise argparse.ArgumentTypeError(f"must lie in [0, 100], got {s}")
    return v


def add_run_args(sp: argparse.ArgumentParser, weights: bool = True) -> None:
    """RUN_DIR, and with ``weights`` the checkpoint choice, its verification and the device."""
    sp.add_argument("run_dir", metavar="RUN_DIR", help="a finished dipaco-train run directory")
    if weights:
        sp.add_argument("--checkpoint", default=None, metavar="ROUND",
                        help="round number, round_NNNNNN name or path (default: newest)")
        sp.add_argument("--fast-verify", action="store_true",
                        help="hash only the module files read, not the whole checkpoint")
        sp.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                        help="where the path models run (default: the run's trainer.device; auto = CUDA if present)")


def add_inputs(sp: argparse.ArgumentParser, allow_text: bool) -> None:
    """The documents a verb reads: ``--text`` or the run's own splits, or ``--file``."""
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
    sp.add_argument("--text-field", default=None, help="field holding the text in --file (default: text); "
                    "malformed lines are skipped and counted on stderr")


# The flags that act with one input mode only, and their defaults there (their parser
# default is None, so a flag given is told from one left out).
FILE_ONLY: dict[str, Any] = {"text_field": "text"}


def input_mode(args: argparse.Namespace) -> str:
    """The input flag ``args`` reads its documents by (``--file``, ``--prompt``, ``--text``, ...)."""
    for dest in ("file", "prompt", "text", "validation", "split"):
        if getattr(args, dest, None) not in (None, False):
            return "--" + dest
    raise ValueError("no input mode given")  # argparse's required group makes this unreachable


def mode_flags(args: argparse.Namespace, only: dict[str, dict[str, Any]]) -> None:
    """Refuse a flag given with an input mode it does nothing in (it would be ignored,
    silently), then fill in the defaults of the flags of the mode given. ``only``: input
    flag -> ``{dest: default}`` of the flags that act with it alone."""
    mode = input_mode(args)
    for other, flags in only.items():
        if other == mode:
            continue
        for dest in flags:
            if getattr(args, dest, None) not in (None, False):
                flag = "--" + dest.replace("_", "-")
                fail(f"{flag} goes with {other}, not {mode} (it would do nothing): drop {flag}, or read the "
                     f"input with {other}")
    for dest, default in only.get(mode, {}).items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)


def read_jsonl(path: str, text_field: str) -> tuple[list[str], int]:
    """Texts of a jsonl file and the lines skipped, by the training readers' rules: a regular
    file only (a FIFO never blocks), and each bad line costs itself only, counted by reason."""
    texts, skipped = read_jsonl_records(path, text_field)
    return [t for t, _ in texts], skipped


def read_jsonl_records(path: str, text_field: str) -> tuple[list[tuple[str, dict]], int]:
    """:func:`read_jsonl` keeping each usable line's whole record beside its text."""
    if not os.path.isfile(path):
        what = "does not exist" if not os.path.lexists(path) else "is not a regular file"
        fail(f"--file {path} {what} (need a JSON-lines file: one JSON object per line)")
    records: dict[str, int] = {}
    cleaner = Cleaner(DataConfig(min_doc_chars=0, max_doc_chars=0), text_field, None, None)  # any length, never cut
    out = [(t, rec) for _, rec in iter_json_lines(path, path, records)
           if (t := cleaner.text_of(rec, truncated=False)) is not None]
    records.pop("blank_line", None)  # an empty line is not a document, nor a bad one
    reasons = {k: records.get(k, 0) + cleaner.skipped.get(k, 0) for k in {*records, *cleaner.skipped}}
    skipped = sum(reasons.values())
    if skipped:
        why = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items()))
        print(f"dipaco: skipped {skipped} line(s) of {path}: {why} (text field {text_field!r})", file=sys.stderr)
    if not out:
        fail(f"{path} has no usable document (need one JSON object per line with a string "
             f"field {text_field!r}; set --text-field)")
    return out, skipped


def texts_of(args: argparse.Namespace) -> tuple[list[str], int]:
    """The documents of ``--text`` or ``--file`` and the count of skipped lines."""
    mode_flags(args, {"--file": FILE_ONLY})
    if getattr(args, "text", None):
        return list(args.text), 0
    return read_jsonl(args.file, args.text_field)


def open_run(args: argparse.Namespace, need_weights: bool = True) -> InferenceRun:
    """The run named by the common arguments, its checkpoint verified once for this process."""
    return InferenceRun.open(args.run_dir, checkpoint=getattr(args, "checkpoint", None),
                             verify="read" if getattr(args, "fast_verify", False) else "all",
                             need_weights=need_weights, device=getattr(args, "device", None))


def out_file(args: argparse.Namespace, what: str) -> Optional[Path]:
    """``--out`` (with ``--force``) of ``score`` and ``eval``, checked before any work by the
    one rule of a command's output file (dipaco/run/owned.py: ``check_out_file``)."""
    if args.out is None:
        if args.force:
            fail("--force replaces an earlier --out report: drop --force, or add --out F")
        return None
    return check_out_file(args.out, what, again=args.force)


def emit(line: str) -> None:
    """One line to stdout, flushed (a reader sees whole lines as they are made)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
