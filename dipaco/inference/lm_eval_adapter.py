"""The routed model as an lm-evaluation-harness model (the one module that imports ``lm_eval``).

    lm = DipacoLM(run=InferenceRun.open("runs/x"))             # or DipacoLM(run=..., dense=True)
    lm_eval.simple_evaluate(model=lm, tasks=[...])             # or model="dipaco", model_args="run_dir=..."
    report = evaluate_tasks(run, ["my_task"], include_path="tasks/", dense=True)

Routing (docs/serving.md, "lm-evaluation-harness"):

* **loglikelihood** (context, continuation): routed on the **context**'s first
  ``prefix_tokens`` tokens, never on the continuation. Every choice of a multiple-choice
  question has the same context, so all its choices are scored by the same path: the
  comparison between choices is between continuations under one model, as for a dense
  model (routing on context + choice would let each choice pick the path that likes it).
  An empty context is lm-eval's end-of-text token, routed as such.
* **Truncation**: context + continuation longer than ``model.max_seq_len + 1`` tokens is
  left-truncated, as lm-eval's Hugging Face model does; the path is still the one of the
  untruncated context's prefix (the routing rule of every inference verb).
* **loglikelihood_rolling**: lm-eval's protocol (every token of the document scored, the
  first conditioned on end-of-text, disjoint windows of ``max_seq_len`` targets, each
  with the longest context that fits); the whole document is routed once, on its own
  first ``prefix_tokens`` tokens (the router's rule for documents), so those tokens are
  scored by a path chosen on them (``dipaco-infer score`` gives them no loss instead).
* **generate_until**: routed on the context's prefix (:class:`RoutedEngine`); the text is
  cut at the first ``until`` string.

Requests are batched by path (:mod:`dipaco.inference.loglik`): each path is loaded once,
at most ``max_loaded_paths`` at a time.
"""
from __future__ import annotations

import functools
import os
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from lm_eval import evaluator as lm_evaluator
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from dipaco.inference.lm_generate import generate_texts
from dipaco.inference.loglik import DenseModel, RoutedModels, TokenRequest, score_requests
from dipaco.inference.run import InferenceRun

# datasets' builders that read local files (data_files) and need no hub
_LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")


class LmEvalError(ValueError):
    """A task or request the adapter refuses (one line for the CLI)."""


_OURS = "_dipaco_internal"  # set on an exception raised inside DipacoLM's own code


def _ours(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark what escapes a :class:`DipacoLM` method as dipaco's (a bug to report, with its
    traceback), so that :func:`evaluate_tasks` can tell it from what lm-eval raises about a
    task (a split, a field, a few-shot count its YAML or data cannot give)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LmEvalError:
            raise
        except Exception as e:
            setattr(e, _OURS, True)
            raise
    return wrapper


@register_model("dipaco")
class DipacoLM(TemplateLM):
    """A finished run's routed model (or its dense baseline) for lm-evaluation-harness.

    Args:
        run_dir: the run to open (``simple_evaluate(model="dipaco", model_args="run_dir=...")``), or
        run: an :class:`InferenceRun` already open.
        dense: score with the run's same-size dense baseline instead of the routed paths.
        batch_size: requests per forward pass (and sequences per generation batch).
        max_loaded_paths: paths kept in memory at once (least recently used dropped first).
        device: ``auto`` | ``cuda`` | ``cpu`` when opening ``run_dir``.
    """

    def __init__(self, run_dir: Optional[str] = None, *, run: Optional[InferenceRun] = None, dense: bool = False,
                 batch_size: int = 16, max_loaded_paths: int = 1, device: Optional[str] = None,
                 **_ignored: Any) -> None:
        super().__init__()
        if run is None:
            if run_dir is None:
                raise LmEvalError("DipacoLM needs run_dir= (a finished dipaco-train run) or run=")
            run = InferenceRun.open(run_dir, device=device)
        self.run = run
        self.dense = str(dense).lower() in ("true", "1", "yes")  # model_args strings: "dense=false"
        self.models = DenseModel(run.dense_model()) if self.dense else RoutedModels(run, int(max_loaded_paths))
        self.batch_size = int(batch_size)
        self.max_loaded_paths = int(max_loaded_paths)
        self.requests_per_path: Counter = Counter()  # what each path scored or generated
        self.last_paths: list[int] = []

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return int(self.run.tokenizer.eos_id)

    @property
    def max_length(self) -> int:
        return int(self.run.cfg.model.max_seq_len)

    @_ours
    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.run.encode(string)  # no special token is ever added (as in training)

    @_ours
    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.run.tokenizer.decode(list(tokens))

    # ---------------------------------------------------------------- scoring

    def _score(self, reqs: list[TokenRequest], paths: Optional[list[int]] = None) -> list:
        try:
            scores = score_requests(reqs, self.models, batch_size=self.batch_size, paths=paths)
        except ValueError as e:
            raise LmEvalError(str(e)) from None
        self.requests_per_path.update(s.path for s in scores)
        return scores

    @_ours
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        """``((context, continuation), context_ids, continuation_ids)`` → ``(logprob, is_greedy)``."""
        todo = [i for i, (_, _, cont) in enumerate(requests) if cont]
        reqs = [TokenRequest(route_ids=requests[i][1], tokens=[*requests[i][1], *requests[i][2]],
                             num_scored=len(requests[i][2])) for i in todo]
        out: list[tuple[float, bool]] = [(0.0, True)] * len(requests)  # an empty continuation: log 1
        self.last_paths = [-1] * len(requests)  # the path of each request (for inspection)
        for i, s in zip(todo, self._score(reqs)):
            out[i] = (s.logprob, s.greedy)
            self.last_paths[i] = s.path
        for (pair, _, _), res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", pair, res)
        return out

    @_ours
    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood, every token scored (see the module docstring)."""
        docs = [self.tok_encode(req.args[0]) for req in requests]
        doc_paths = self.models.route(docs)
        reqs, owner, paths = [], [], []
        for d, (doc, path) in enumerate(zip(docs, doc_paths)):
            windows = lm_utils.get_rolling_token_windows(
                token_list=doc, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)
            for ctx, pred in map(lm_utils.make_disjoint_window, windows):
                reqs.append(TokenRequest(route_ids=doc, tokens=[*ctx, *pred], num_scored=len(pred)))
                owner.append(d)
                paths.append(path)
        totals = [0.0] * len(docs)
        for d, s in zip(owner, self._score(reqs, paths)):
            totals[d] += s.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation

    @_ours
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each context (routed on its prefix) and cut at the first ``until`` string."""
        try:
            texts = generate_texts(self, [req.args for req in requests])
        except ValueError as e:
            raise LmEvalError(str(e)) from None
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts


# --------------------------------------------------------------------------- tasks, offline


def local_task_names(manager: TaskManager, names: Sequence[str], where: str) -> list[str]:
    """The leaf tasks behind ``names`` (groups and tags expanded), each checked to read
    only local files; :class:`LmEvalError` names the first task that would need the hub."""
    index = manager.task_index
    leaves: list[str] = []

    def visit(name: str) -> None:
        entry = index.get(name)
        if entry is None:
            raise LmEvalError(
                f"task {name!r} is not defined by any YAML under {where}: dipaco-infer eval runs offline, on local "
                "task files only (lm-eval's built-in tasks read the Hugging Face hub); write one (docs/serving.md)")
        kind = entry.kind.name
        if kind == "TAG":
            for t in sorted(entry.tags):
                visit(t)
        elif kind == "GROUP":
            for member in entry.cfg.get("task", []):
                if not isinstance(member, str):
                    raise LmEvalError(f"group {name!r} defines a task inline: give each task its own YAML")
                visit(member)
        elif kind == "PY_TASK":
            raise LmEvalError(f"task {name!r} is a Python task class: its data cannot be checked to be local; "
                              "use a YAML task with dataset_path: json and data_files")
        else:
            _check_local(name, entry.cfg or {})
            leaves.append(name)

    for n in names:
        visit(n)
    return list(dict.fromkeys(leaves))


def _check_local(name: str, cfg: dict) -> None:
    source = cfg.get("dataset_path")
    if source in _LOCAL_BUILDERS:
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if not files:
            raise LmEvalError(f"task {name!r} has dataset_path: {source} but no dataset_kwargs.data_files")
        for f in _file_list(files):
            if any(ch in f for ch in "*?["):
                continue  # a pattern: datasets says which files it matched
            problem = _data_file_problem(Path(f).expanduser())
            if problem:
                raise LmEvalError(f"task {name!r}: data file {f} {problem} (relative paths are read "
                                  f"from the working directory, {os.getcwd()})")
    elif not (source and Path(str(source)).expanduser().exists()):
        raise LmEvalError(f"task {name!r} reads dataset_path {source!r} from the Hugging Face hub; dipaco-infer "
                          "eval runs offline: use dataset_path: json with local data_files (docs/serving.md)")


def _data_file_problem(path: Path) -> Optional[str]:
    """Why ``path`` cannot be a task's local data file (``None`` when it can): it must be a
    regular file holding at least one non-blank line; datasets fails on an empty one deep
    inside lm-eval (a StopIteration), which is the user's file to fix, not a bug to report."""
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is not a regular file"
    with open(path, "rb") as fh:
        if not any(line.strip() for line in fh):
            return "is empty (a task needs at least one document)"
    return None


def _file_list(files: Any) -> list[str]:
    if isinstance(files, str):
        return [files]
    if isinstance(files, dict):
        return [f for v in files.values() for f in _file_list(v)]
    return [str(f) for f in files]


@contextmanager
def offline() -> Iterator[None]:
    """Hub access off for lm-eval's call: the variables, and the flags ``datasets`` and
    ``huggingface_hub`` read once at import (dipaco imports them before this runs)."""
    import datasets.config
    import huggingface_hub.constants as hub

    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    saved = (datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE)
    os.environ.update({k: "1" for k in saved_env})
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- a whole evaluation


def resolve_tasks(tasks: Sequence[str], include_path: Optional[str]) -> tuple[TaskManager, list[str]]:
    """lm-eval's task index of ``include_path`` (its built-in tasks left out: they read the
    hub) and the leaf tasks behind ``tasks``, each checked to read local files only."""
    if not include_path:
        raise LmEvalError(f"no task folder: give --include-path DIR holding the YAML of {', '.join(tasks)} "
                          "(dipaco-infer eval runs offline, on local task files only; docs/serving.md)")
    manager = TaskManager(include_path=include_path, include_defaults=False)
    return manager, local_task_names(manager, tasks, f"--include-path {include_path}")


def evaluate_tasks(run: InferenceRun, tasks: Sequence[str], *, include_path: Optional[str] = None,
                   limit: Optional[int] = None, num_fewshot: Optional[int] = None, batch_size: int = 16,
                   max_loaded_paths: int = 1, dense: bool = False, bootstrap_iters: int = 1000,
                   resolved: Optional[tuple[TaskManager, list[str]]] = None) -> dict:
    """Run lm-eval's ``simple_evaluate`` on local tasks with the routed model (and the dense
    baseline with ``dense``); return ``{"routed": results, "dense": results | None, ...}``.

    ``results`` is lm-eval's ``results`` dict (task → ``"metric,filter"`` → value) plus
    ``requests_per_path`` (how many requests each path served). ``resolved``: the output
    of :func:`resolve_tasks` when already called.
    """
    manager, names = resolved or resolve_tasks(tasks, include_path)
    report: dict[str, Any] = {"tasks": names, "num_fewshot": num_fewshot, "limit": limit}
    kinds = [("routed", False)] + ([("dense", True)] if dense else [])
    if dense:
        run.dense_model()  # refused before any routed work when the run has no baseline
    for key, is_dense in kinds:
        lm = DipacoLM(run=run, dense=is_dense, batch_size=batch_size, max_loaded_paths=max_loaded_paths)
        start = time.perf_counter()
        try:
            with offline():
                out = lm_evaluator.simple_evaluate(
                    model=lm, tasks=list(names), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
                    batch_size=batch_size, bootstrap_iters=bootstrap_iters, log_samples=False)
        except (LmEvalError, OSError, MemoryError):
            raise  # already one line, or the environment's (the error boundary names the file)
        except Exception as e:
            if getattr(e, _OURS, False):
                raise  # dipaco's own code failed: an internal error with its traceback file
            # lm-eval building or reading a task: what the YAML asks of its data does not hold
            first = " ".join(str(e).split())[:200]
            raise LmEvalError(f"lm-eval could not run {', '.join(names)} ({type(e).__name__}: {first}); check "
                              "each task's YAML against its data: the split names, the fields doc_to_* read, "
                              "--num-fewshot against its documents (--debug prints the traceback)") from e
        report[key] = {"results": _plain(out["results"]), "seconds": round(time.perf_counter() - start, 2),
                       "requests_per_path": {str(p): n for p, n in sorted(lm.requests_per_path.items())}}
        report.setdefault("higher_is_better", _plain(out.get("higher_is_better", {})))
        report.setdefault("n_shot", _plain(out.get("n-shot", {})))
        report.setdefault("lm_eval_version", out.get("lm_eval_version"))
    report.setdefault("dense", None)
    return report


def _plain(obj: Any) -> Any:
    """lm-eval's results with numpy scalars as Python numbers (JSON-ready)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj
