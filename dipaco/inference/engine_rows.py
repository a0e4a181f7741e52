"""The rows of :class:`~dipaco.inference.engine.RoutedEngine` and one path's batch of them.

A row follows :func:`~dipaco.inference.generate_routed`'s rules exactly, one token per
step: when it starts on a path its context is encoded alone (the last ``max_seq_len``
tokens, batch 1, as a fresh one-prompt decoder does), then it decodes in the batch
(:func:`modules.row_decode.decode_rows`) until its cache is full, after which it
re-encodes its trailing window every step (the long-context rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import torch

from dipaco.inference.generate import Generation
from dipaco.inference.sampling import sample_token, shape_logits, shapes_logits, token_logprobs
from dipaco.runtime.device import model_device
from modules import PathModel
from modules.kv_cache import KVCache
from modules.row_decode import RowCache, decode_rows

if TYPE_CHECKING:
    from dipaco.inference.run import InferenceRun


# one token's log-probability and the likeliest tokens' (id, log-probability), likeliest first
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class Request:
    """One prompt to continue, with its own decoding settings.

    The logit rules (``logit_bias``, the penalties, ``min_tokens``) are
    :func:`~dipaco.inference.sampling.shape_logits`'; ``stop_ids`` end the row as the
    end-of-text token does (the token is kept, finish reason ``stop``). ``logprobs`` N: each
    generated token comes with its log-probability and the N likeliest tokens';
    ``prompt_logprobs`` N: so do the prompt's tokens (but the first), on the row's first
    event. With ``prompt_logprobs``, ``max_new_tokens=0`` scores the prompt and generates
    nothing.
    """

    prompt_ids: list[int]
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0 = greedy
    top_k: Optional[int] = None
    top_p: Optional[float] = None     # nucleus, (0, 1]
    seed: int = 0                     # per-request sampler seed
    stop_at_eos: bool = True
    reroute_every: Optional[int] = None   # W; None = routed once by the prompt
    min_p: Optional[float] = None     # keep tokens at least this fraction of the likeliest's probability
    min_tokens: int = 0               # end-of-text and stop_ids are held back until this many tokens
    stop_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[int, float]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """One request being generated.

    Attributes:
        windows: path of each re-routing window decided so far (window 0 without re-routing).
        path: the path generating the next token.
        since: the step it started waiting for ``path`` (scheduling).
        slot: its slot in the batch's :class:`RowCache` while it decodes there.
        start: sequence position of the slot's first cached token.
    """

    rid: int
    req: Request
    out: Generation
    seq: list[int]
    windows: dict[int, int] = field(default_factory=dict)
    path: int = -1
    since: int = 0
    slot: Optional[int] = None
    start: int = 0
    generator: Optional[torch.Generator] = None
    logprob: Optional[TokenLogprob] = None  # of the token the last step gave it (Request.logprobs)
    # the prompt's tokens' (None for the first, and for tokens before the window it was read
    # through); set when its context is first encoded, handed out once with its first event
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    scored: bool = False  # the prompt's log-probabilities have been computed

    @cached_property
    def shaped(self) -> bool:
        """Whether its logits go through :func:`shape_logits` before a token is chosen (asked
        of every row at every step: computed once)."""
        return shapes_logits(self.req)

    def path_at(self, pos: int) -> int:
        """The path of sequence position ``pos`` (its window must have been routed)."""
        W = self.req.reroute_every
        return self.windows[0 if W is None else pos // W]

    def record_windows(self, run: "InferenceRun") -> list[int]:
        """``Generation.window_paths``: windows never needed for generating are routed now,
        in one call, by the rule and on the sequence :func:`generate_routed` uses."""
        W = self.req.reroute_every
        if W is None:
            return [self.windows[0]]
        n_windows = -(-len(self.seq) // W)
        missing = [j for j in range(n_windows) if j not in self.windows]
        if missing:
            ctxs = [run.router.window_context(self.seq, j, W) for j in missing]
            self.windows.update(zip(missing, map(int, run.router.route_contexts(ctxs))))
        return [self.windows[j] for j in range(n_windows)]


class PathBatch:
    """The rows one path is generating: ``slotted`` decode together from the cache (slot
    ``i`` = ``slotted[i]``), ``windowed`` re-encode their last ``max_seq_len`` tokens each
    step, ``fresh`` joined since the last step and are encoded at the next."""

    def __init__(self, model: PathModel, path: int, max_rows: int, use_kv_cache: bool,
                 cache: Optional[RowCache] = None, exact: bool = True, eos: Optional[int] = None) -> None:
        self.model, self.path, self.max_rows = model, int(path), int(max_rows)
        self.eos = eos  # held back by a row's min_tokens
        self.exact = bool(exact)  # decode_rows' mode: row-exact (default) or one product per layer
        self.device = model_device(model)
        self.max_len = model.cfg.max_seq_len
        self.cache: Optional[RowCache] = None
        if use_kv_cache:  # every path has the same shapes: the previous path's buffers serve
            same = cache is not None and cache.slots == max_rows and cache.k.device == self.device
            self.cache = cache if same else RowCache(model, max_rows)
        self.slotted: list[Row] = []
        self.windowed: list[Row] = []
        self.fresh: list[Row] = []

    @property
    def rows(self) -> list[Row]:
        return self.slotted + self.windowed + self.fresh

    def free_rows(self) -> int:
        return self.max_rows - len(self.slotted) - len(self.windowed) - len(self.fresh)

    def join(self, row: Row) -> None:
        """``row`` starts generating with this path (its context is encoded at the next step)."""
        row.out.switches.append((len(row.seq), self.path))
        self.fresh.append(row)

    def leave(self, row: Row) -> None:
        """``row`` stops here (finished, cancelled or re-routed); the slots stay packed."""
        if row.slot is not None:
            last = len(self.slotted) - 1
            if row.slot != last:
                self.cache.move(last, row.slot)
                self.slotted[row.slot] = self.slotted[last]
                self.slotted[row.slot].slot = row.slot
            self.slotted.pop()
            row.slot = None
        elif row in self.windowed:
            self.windowed.remove(row)
        elif row in self.fresh:
            self.fresh.remove(row)

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    def _ids_rows(self, ids: list[list[int]]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _encode(self, row: Row) -> torch.Tensor:
        """Next-token logits of ``row`` from its last ``max_seq_len`` tokens, alone (batch 1)."""
        row.start = max(0, len(row.seq) - self.max_len)
        window = row.seq[row.start:]
        if self.cache is None:
            logits = self.model(self._ids(window))[0]
        else:
            scratch = self.cache.scratch
            scratch.reset()
            logits = self.model(self._ids(window), scratch)[0]
        if row.req.prompt_logprobs is not None and not row.scored:
            self._score_prompt(row, logits, window)
        return logits[-1]

    @staticmethod
    def _score_prompt(row: Row, logits: torch.Tensor, window: list[int]) -> None:
        """The prompt's log-probabilities from the forward that encoded its context (no
        second pass): token ``j`` of the window from position ``j - 1``."""
        n = len(row.out.prompt)
        scored = token_logprobs(logits[:n - row.start - 1], window[1:n - row.start], row.req.prompt_logprobs)
        row.prompt_logprobs = [None] * (row.start + 1) + list(scored)
        row.scored = True

    def _slot(self, row: Row, scratch: KVCache, i: int = 0, n: Optional[int] = None) -> None:
        """``row`` takes the next slot, with the positions of ``scratch``'s row ``i``."""
        row.slot = len(self.slotted)
        self.cache.fill(row.slot, scratch, i, n)
        self.slotted.append(row)

    def _encode_padded(self, rows: list[Row]) -> torch.Tensor:
        """Next-token logits ``[len(rows), V]`` of rows whose whole context fits a slot, in one
        forward (``exact=False`` only): the contexts right-padded to the longest, so under the
        causal mask a row's real positions never see its padding; each row then takes a slot
        with its own positions. A row's bits may depend on the others (the products are over
        the whole batch), which is what fast mode allows."""
        lengths = [len(r.seq) for r in rows]
        width = max(lengths)
        ids = self._ids_rows([r.seq + [0] * (width - len(r.seq)) for r in rows])
        scratch = self.model.new_kv_cache(len(rows), width)
        logits = self.model(ids, scratch)  # [G, width, V]
        for i, row in enumerate(rows):
            row.start = 0
            self._slot(row, scratch, i, lengths[i])
        last = torch.tensor([n - 1 for n in lengths], device=logits.device)
        return logits[torch.arange(len(rows), device=logits.device), last]

    @torch.no_grad()
    def step(self) -> tuple[list[Row], list[int]]:
        """One new token for every row: (the rows, their tokens)."""
        for row in [r for r in self.slotted if self.cache.lengths[r.slot] >= self.max_len]:
            self.leave(row)  # cache full: from now on the window slides every step
            self.windowed.append(row)
        rows: list[Row] = list(self.slotted)
        parts: list[torch.Tensor] = []
        if self.slotted:
            last = torch.tensor([r.seq[-1] for r in self.slotted], dtype=torch.long, device=self.device)
            parts.append(decode_rows(self.model, last, self.cache, self.exact))
        for row in self.windowed:
            rows.append(row)
            parts.append(self._encode(row).unsqueeze(0))
        fresh, self.fresh = self.fresh, []
        if not self.exact and self.cache is not None:
            # fast mode: every fresh row whose context fits a slot is encoded in one padded call
            fits = [r for r in fresh if len(r.seq) < self.max_len and r.req.prompt_logprobs is None]
            if len(fits) > 1:
                fresh = [r for r in fresh if r not in fits]
                rows.extend(fits)
                parts.append(self._encode_padded(fits))
        for row in fresh:
            rows.append(row)
            parts.append(self._encode(row).unsqueeze(0))
            if self.cache is not None and self.cache.scratch.length < self.max_len:
                self._slot(row, self.cache.scratch)
            else:
                self.windowed.append(row)
        logits = torch.cat(parts).float()
        tokens = logits.argmax(dim=-1).tolist()  # greedy rows: the first of equal maxima, as one prompt
        chosen = [i for i, row in enumerate(rows) if row.req.temperature > 0 or row.shaped]
        if chosen:
            # Sampling happens on the CPU, as in one-prompt generation: a CUDA generator draws a
            # different stream from a CPU one seeded alike, so a row's sample would depend on the
            # device. One transfer of these rows' logits per step.
            host = logits[torch.tensor(chosen, device=logits.device)].cpu()
            for j, i in enumerate(chosen):
                row = rows[i]
                row_logits = shape_logits(host[j], row.req, row.out.prompt, row.out.tokens, self.eos) \
                    if row.shaped else host[j]
                tokens[i] = int(sample_token(row_logits, row.req.temperature, row.req.top_k, row.req.top_p,
                                             self._generator(row), row.req.min_p))
        for i, row in enumerate(rows):  # each row alone: its numbers never depend on its batch
            if row.req.logprobs is not None:
                row.logprob = token_logprobs(logits[i:i + 1], [tokens[i]], row.req.logprobs)[0]
        return rows, tokens

    @staticmethod
    def _generator(row: Row) -> torch.Generator:
        """The row's own sampler, seeded by its request: a CPU generator on every device."""
        if row.generator is None:
            row.generator = torch.Generator().manual_seed(int(row.req.seed))
        return row.generator
