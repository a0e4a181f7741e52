"""The batched routed engine: many prompts, each answered by its path, decoded in batches.

    engine = RoutedEngine(run, max_batch_size=32)
    gens = engine.generate([Request(run.encode(t), max_new_tokens=64) for t in texts])

    rid = engine.submit(Request(ids, temperature=0.8, top_p=0.9, seed=7))   # any thread
    while engine.has_work():
        for event in engine.step(): ...                                     # one thread

What it does, in the rules of :mod:`dipaco.inference` (docs/serving.md says the same):

* **Routing.** Requests submitted since the last step are routed in one router call
  (``route_batch`` on the prompts; with ``reroute_every`` the window of the first new
  token, ``route_contexts``) and queue for their path.
* **One path at a time.** A step advances one path's batch: at most ``max_batch_size``
  rows, each at its own position (:mod:`modules.row_decode`). Rows waiting for that path
  join at a step, a row leaves at its eos, its ``max_new_tokens`` or its cancellation.
  Models come from a :class:`PathLoader` keeping ``max_loaded_paths`` paths in memory.
* **No starvation.** The engine stays on a path while it has rows, unless a row of
  another path has waited ``patience`` steps: then the path admits no new row, its batch
  drains, and the path whose row waited longest goes next (:meth:`generate`, offline,
  runs each path to its end instead: fewer switches, the same tokens).
* **Re-routing in batch.** A row whose next window picks another path leaves the batch and
  queues for that path; it re-encodes its context there (a cache belongs to one path).
* **Same tokens as one prompt.** Each row computes exactly what
  :func:`~dipaco.inference.generate_routed` computes for it alone (prefill at batch 1,
  row-exact batched decode, the same long-context rule), and samples with its own
  generator seeded by ``Request.seed``: batching never changes a result.
* **A damaged file fails what reads it.** A module file that does not match its manifest
  when a path is loaded (each read is checked: :meth:`InferenceRun.load_module_into`)
  finishes that path's rows with ``finish_reason`` ``"error: <the file and why>"``; the
  engine and every other path go on.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from dipaco.inference.engine_rows import PathBatch, Request, Row, TokenLogprob
from dipaco.inference.generate import Generation
from dipaco.inference.sampling import check_sampling, check_shaping
from dipaco.storage.tensor_io import CheckpointError

if TYPE_CHECKING:
    from dipaco.inference.run import InferenceRun


@dataclass
class TokenEvent:
    """What one engine step reports for one request.

    ``finish_reason``: ``eos`` (the end-of-text token), ``stop`` (one of the request's
    ``stop_ids``), ``length`` (``max_new_tokens``; a row longer than the model's context
    slides on, by the long-context rule, so a full context never ends one) or ``cancelled``.
    """

    request_id: int
    token: Optional[int]              # the new token (None when finishing without a token)
    path: int                         # the path that produced it
    finished: bool
    finish_reason: Optional[str]      # "eos" | "stop" | "length" | "cancelled"
    generation: Optional[Generation] = field(default=None, repr=False)  # the whole result, on the finishing event
    logprob: Optional[TokenLogprob] = None  # the token's, with the likeliest alternatives (Request.logprobs)
    # the prompt's tokens' (Request.prompt_logprobs), on the request's first event only
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = field(default=None, repr=False)


def check_request(req: Request, vocab_size: int) -> list[int]:
    """The prompt as ints; ``ValueError`` (one line) for anything outside its domain."""
    try:
        prompt = [int(t) for t in req.prompt_ids]
    except (TypeError, ValueError):
        raise ValueError("prompt_ids must be a list of token ids (integers)") from None
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {req.max_new_tokens!r}")
    check_sampling(req.temperature, req.top_k, req.top_p, req.min_p)
    check_shaping(req, vocab_size)
    if isinstance(req.seed, bool) or not isinstance(req.seed, int) or not 0 <= req.seed < 2**63:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {req.seed!r}")
    W = req.reroute_every
    if W is not None and (isinstance(W, bool) or not isinstance(W, int) or W < 1):
        raise ValueError(f"reroute_every must be an integer >= 1 token, got {W!r}")
    return prompt


class RoutedEngine:
    """Batched routed generation over a finished run (see the module docstring).

    Args:
        run: the opened run (:meth:`InferenceRun.open`).
        max_batch_size: rows decoded together in one step.
        max_loaded_paths: paths kept in memory (the :class:`PathLoader` bound).
        use_kv_cache: ``False`` re-encodes each row's whole window every step (slow; same tokens).
        patience: steps a row of another path may wait before the current path stops admitting.
        exact: ``True`` (default): every row gets the tokens one-prompt generation gives it
            (each linear layer one matrix-vector product per row). ``False``: one matrix
            product per layer for the whole batch and the prompts joining at a step encoded
            in one padded forward, faster; a row's float bits may then depend on its batch,
            so a greedy near-tie can differ from one-prompt generation.
    """

    def __init__(self, run: "InferenceRun", *, max_batch_size: int = 32, max_loaded_paths: int = 1,
                 use_kv_cache: bool = True, patience: int = 64, exact: bool = True) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1 step, got {patience}")
        self.run = run
        self.loader = run.loader(cache_size=max_loaded_paths)
        self.max_batch_size = int(max_batch_size)
        self.use_kv_cache = bool(use_kv_cache)
        self.exact = bool(exact)
        self.patience: Optional[int] = int(patience)
        self.eos = run.tokenizer.eos_id
        self.vocab_size = int(run.cfg.model.vocab_size)
        self._lock = threading.Lock()
        self._inbox: list[tuple[int, Request, list[int]]] = []
        self._cancels: set[int] = set()
        self._next_id = 0
        self._rows: dict[int, Row] = {}
        self._queues: dict[int, deque[int]] = {}
        self._batch: Optional[PathBatch] = None  # the current path's rows (one path at a time)
        self._step_no = 0

    # ---------------------------------------------------------------- any thread

    def submit(self, request: Request) -> int:
        """Queue ``request``; returns its id. Thread-safe; ``ValueError`` (one line) if invalid."""
        prompt = check_request(request, self.vocab_size)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._inbox.append((rid, request, prompt))
        return rid

    def cancel(self, request_id: int) -> None:
        """Stop ``request_id``; its row is freed (and reported ``cancelled``) at the next step."""
        with self._lock:
            self._cancels.add(int(request_id))

    def has_work(self) -> bool:
        """Whether a :meth:`step` would do anything."""
        with self._lock:
            return bool(self._inbox or self._rows or self._cancels)

    def close(self) -> None:
        """Nothing to release: the engine's models belong to its run (the server's engine
        thread calls it on every engine; :class:`dipaco.serve.engine_process.EngineProcess`
        stops its process)."""

    # ---------------------------------------------------------------- the engine thread

    def step(self) -> list[TokenEvent]:
        """Admit new requests, apply cancellations, and advance one path's batch by one token."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, set()
        now = self._step_no
        self._step_no += 1
        events = self._admit(inbox, now)
        for rid in sorted(cancels):
            if rid in self._rows:
                events.append(self._finish(self._rows[rid], None, "cancelled"))
        path = self._pick_path(now)
        if path is None:
            return events
        if self._batch is None or self._batch.path != path:
            try:
                model = self.loader.get(path)
            except CheckpointError as e:  # a damaged file fails the rows of the paths that read it, only
                for rid in list(self._queues.get(path, ())):
                    events.append(self._finish(self._rows[rid], None, f"error: {e}"))
                return events
            self._batch = PathBatch(model, path, self.max_batch_size, self.use_kv_cache,
                                    self._batch.cache if self._batch is not None else None, self.exact, self.eos)
        batch = self._batch
        queue = self._queues.get(path)
        if queue and not (batch.rows and self._overdue(now, path)):  # draining: admit no more
            while queue and batch.free_rows():
                batch.join(self._rows[queue.popleft()])
            if not queue:
                del self._queues[path]
        rows, tokens = batch.step()
        self._after_tokens(rows, tokens, now, events)
        return events

    def generate(self, requests: Sequence[Request], *,
                 on_result: Optional[Callable[[int, Generation], None]] = None) -> list[Generation]:
        """Every request to its end (offline); results in input order. ``on_result(index, gen)``
        is called as each completes. Not to be mixed with another thread's :meth:`step` loop."""
        ids = [self.submit(r) for r in requests]
        index = {rid: i for i, rid in enumerate(ids)}
        out: list[Optional[Generation]] = [None] * len(ids)
        patience, self.patience = self.patience, None  # offline: each path to its end
        try:
            while any(g is None for g in out):
                for ev in self.step():
                    i = index.get(ev.request_id)
                    if ev.finished and i is not None:
                        out[i] = ev.generation
                        if on_result is not None:
                            on_result(i, ev.generation)
        finally:
            self.patience = patience
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- internals

    def _admit(self, inbox: list[tuple[int, Request, list[int]]], now: int) -> list[TokenEvent]:
        """Route the new requests (one router call per kind) and queue them for their paths."""
        rows = [Row(rid, req, Generation(prompt=list(prompt)), list(prompt)) for rid, req, prompt in inbox]
        once = [r for r in rows if r.req.reroute_every is None]
        if once:
            for r, p in zip(once, self.run.router.route_batch([np.asarray(r.seq, np.int64) for r in once])):
                r.windows[0] = int(p)
        self._route_next([r for r in rows if r.req.reroute_every is not None])
        events = []
        for r in rows:
            self._rows[r.rid] = r
            r.path = r.path_at(len(r.seq))
            if r.req.max_new_tokens == 0 and r.req.prompt_logprobs is None:
                events.append(self._finish(r, None, "length"))
            else:
                self._enqueue(r, now)
        return events

    def _route_next(self, rows: Sequence[Row]) -> None:
        """Route the window of each row's next token where not yet known, in one router call."""
        need = [r for r in rows if r.req.reroute_every is not None
                and len(r.seq) // r.req.reroute_every not in r.windows]
        if need:
            router = self.run.router
            ctxs = [router.window_context(r.seq, len(r.seq) // r.req.reroute_every, r.req.reroute_every)
                    for r in need]
            for r, p in zip(need, router.route_contexts(ctxs)):
                r.windows[len(r.seq) // r.req.reroute_every] = int(p)

    def _enqueue(self, row: Row, now: int) -> None:
        row.since = now
        self._queues.setdefault(row.path, deque()).append(row.rid)

    def _after_tokens(self, rows: list[Row], tokens: list[int], now: int, events: list[TokenEvent]) -> None:
        going = []
        for row, tok in zip(rows, tokens):
            if row.req.max_new_tokens == 0:  # its prompt scored (prompt_logprobs), no token wanted
                events.append(self._finish(row, None, "length"))
                continue
            row.seq.append(tok)
            row.out.tokens.append(tok)
            if row.req.stop_at_eos and tok == self.eos:
                row.out.stopped_at_eos = True
                events.append(self._finish(row, tok, "eos"))
            elif tok in row.req.stop_ids:
                events.append(self._finish(row, tok, "stop"))
            elif len(row.out.tokens) >= row.req.max_new_tokens:
                events.append(self._finish(row, tok, "length"))
            else:
                events.append(self._event(row, TokenEvent(row.rid, tok, row.path, False, None)))
                going.append(row)
        self._route_next(going)
        for row in going:
            p = row.path_at(len(row.seq))
            if p != row.path:  # re-routed: its cache belongs to the old path
                self._batch.leave(row)
                row.path = p
                self._enqueue(row, now)

    def _finish(self, row: Row, token: Optional[int], reason: str) -> TokenEvent:
        """Remove ``row`` wherever it is and report its result."""
        del self._rows[row.rid]
        if self._batch is not None:
            self._batch.leave(row)  # a no-op when it is not there
        if row.path in self._queues and row.rid in self._queues[row.path]:
            self._queues[row.path].remove(row.rid)
            if not self._queues[row.path]:
                del self._queues[row.path]
        row.out.finish_reason = reason
        row.out.window_paths = row.record_windows(self.run)
        return self._event(row, TokenEvent(row.rid, token, row.path, True, reason, row.out))

    @staticmethod
    def _event(row: Row, event: TokenEvent) -> TokenEvent:
        """``event`` with the log-probabilities the row asked for: its token's, and on its first
        event its prompt's."""
        if event.token is not None:
            event.logprob, row.logprob = row.logprob, None
        if row.prompt_logprobs is not None:
            event.prompt_logprobs, row.prompt_logprobs = row.prompt_logprobs, None
        return event

    def _overdue(self, now: int, current: Optional[int]) -> bool:
        """A row of another path has waited ``patience`` steps (never offline)."""
        if self.patience is None:
            return False
        return any(now - self._rows[q[0]].since >= self.patience for p, q in self._queues.items() if p != current)

    def _pick_path(self, now: int) -> Optional[int]:
        """The path the step advances: the current one while it has rows (unless another
        path is overdue and the batch has drained), else the one whose row waited longest."""
        cur = self._batch.path if self._batch is not None else None
        if self._batch is not None and self._batch.rows:
            return cur
        if cur in self._queues and not self._overdue(now, cur):
            return cur
        if not self._queues:
            return None
        # oldest wait first; among equals the path of the earliest request, so that output
        # kept in input order (generate --file) flows as early as it can
        return min(self._queues, key=lambda p: (self._rows[self._queues[p][0]].since, self._queues[p][0]))
