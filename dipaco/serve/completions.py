"""One ``POST /v1/completions`` request in flight, free of any web framework.

:meth:`CompletionService.check` checks a parsed request against the model and the limits
(the length rule: prompt + ``max_tokens`` <= the context); :meth:`CompletionService.open`
encodes its prompts and submits one engine row per choice (``best_of``, or ``n``, rows
of each prompt, seeded apart); :meth:`Completion.updates` yields each choice's new text
as tokens arrive, cutting at stop strings (the engine row is cancelled then);
:meth:`Completion.response` and :meth:`Completion.chunk` shape OpenAI's objects (with
``best_of > n``, the ``n`` choices of each prompt whose tokens are likeliest).
:meth:`Completion.cancel` frees every row still generating (a client that left).
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from dipaco.serve.engine_thread import ENGINE_FAILED, EngineDown, EngineThread
from dipaco.serve.errors import APIError, bad_request
from dipaco.serve.choice import Choice, LogprobLog
from dipaco.serve.mailbox import LoopMailbox
from dipaco.serve.model import ServedModel, ServeLimits
from dipaco.serve.schemas import CompletionRequest, check_sampling, prompts_of, stops_of
from dipaco.serve.text import TextAssembler

# the engine's finish reasons in OpenAI's words
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def _raise_if_failed(reason: Any) -> None:
    """A row the engine ended with ``error: ...`` (a damaged checkpoint file of its path:
    that path fails, the engine goes on) is a 500 naming the file."""
    if str(reason).startswith("error: "):
        raise APIError(500, str(reason)[len("error: "):], code="checkpoint_error")


def engine_request(**fields: Any) -> Any:
    """An engine :class:`~dipaco.inference.engine.Request` (imported late: the engine is heavy)."""
    from dipaco.inference.engine import Request

    return Request(**fields)


def choice_seed(seed: int, k: int) -> int:
    """The seed of a prompt's ``k``-th row: the request's own for the first (so ``n=1``
    samples what it always did), mixed with ``k`` for the others."""
    from dipaco.inference.sampling import mixed_seed

    return seed if k == 0 else mixed_seed(seed, k)


@dataclass
class Plan:
    """A checked request: its prompts as token ids, and each row's engine settings."""

    prompts: list[list[int]]
    texts: list[str]                 # each prompt as text, with ``echo`` (which returns it)
    rows: list[dict[str, Any]]       # engine settings of each row, prompt by prompt
    stops: list[str]


class CompletionService:
    """Turns requests into engine rows for one model and one engine thread."""

    def __init__(self, model: ServedModel, engine: EngineThread, limits: ServeLimits, *,
                 make_request: Callable[..., Any] = engine_request) -> None:
        self.model = model
        self.engine = engine
        self.limits = limits
        self.make_request = make_request
        self._mailboxes: dict[asyncio.AbstractEventLoop, LoopMailbox] = {}

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The one mailbox of ``loop`` (its requests' events share its wake-ups)."""
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = LoopMailbox(loop)
            self.engine.add_step_listener(box.flush)  # one wake-up of the loop per step
        return box

    def check_model(self, name: Optional[str]) -> None:
        """404 unless ``name`` is one this server serves (``None``: not given, where optional)."""
        if name is not None and name not in self.model.names:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model.name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")

    def check(self, req: CompletionRequest) -> Plan:
        """The request's plan, or an :class:`APIError` naming what is wrong in one line."""
        self.check_model(req.model)
        check_sampling(req)
        lim = self.limits
        stops = stops_of(req.stop, lim.max_stop_strings)
        prompts = prompts_of(req.prompt)
        per_prompt = req.best_of or req.n
        if len(prompts) * per_prompt > lim.max_choices:
            raise bad_request(f"the request asks for {len(prompts)} prompt(s) x {per_prompt} choice(s); at most "
                              f"{lim.max_choices} choices per request (the server's --max-choices)", "prompt")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens is 0: that generates nothing, which only echo (the prompt and its "
                              "log-probabilities) can use", "max_tokens")
        ids = [self._encode(p, i, len(prompts)) for i, p in enumerate(prompts)]
        vocab = self.model.vocab_size or 2**63
        for name, tokens in (("stop_token_ids", req.stop_token_ids or []),
                             ("logit_bias", [int(k) for k in req.logit_bias or {}])):
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab})", name)
        texts = [p if isinstance(p, str) else self.model.tokenizer.decode(p) for p in prompts] if req.echo else []
        shared = self._settings(req, per_prompt)
        rows = []
        for i, prompt in enumerate(ids):
            max_tokens = self._max_tokens(req, prompt, i, len(ids))
            for k in range(per_prompt):  # without a seed, each row a random one
                seed = secrets.randbits(32) if req.seed is None else choice_seed(req.seed, k)
                rows.append({**shared, "prompt_ids": prompt, "max_new_tokens": max_tokens, "seed": seed})
        return Plan(ids, texts, rows, stops)

    def _settings(self, req: CompletionRequest, per_prompt: int) -> dict[str, Any]:
        """The engine settings every row of the request shares."""
        lim = self.limits
        ranked = per_prompt > req.n  # best_of: rows ranked by their tokens' log-probabilities
        return {"temperature": 1.0 if req.temperature is None else float(req.temperature),
                "top_k": None if req.top_k in (None, -1) else req.top_k,
                "top_p": None if req.top_p in (None, 1) else float(req.top_p),
                "min_p": float(req.min_p) if req.min_p else None, "stop_at_eos": not req.ignore_eos,
                "min_tokens": req.min_tokens or 0, "stop_ids": tuple(req.stop_token_ids or ()),
                "repetition_penalty": 1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
                "presence_penalty": float(req.presence_penalty or 0), "frequency_penalty": float(req.frequency_penalty or 0),
                "logit_bias": {int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None,
                "logprobs": req.logprobs if req.logprobs is not None else (0 if ranked else None),
                "prompt_logprobs": req.logprobs if req.echo and req.logprobs is not None else None,
                "reroute_every": lim.reroute_every if req.reroute_every is None else req.reroute_every}

    def _max_tokens(self, req: CompletionRequest, prompt: list[int], i: int, n: int) -> int:
        """The prompt's ``max_tokens`` by the length rule: prompt + ``max_tokens`` <= the context
        (OpenAI's), unless the server slides past it; the default (16) lowered to what fits
        (and to ``--max-tokens-cap``)."""
        lim, context = self.limits, self.model.max_seq_len
        where = "the prompt" if n == 1 else f"prompt[{i}]"
        room = context - len(prompt)
        if req.max_tokens is None:
            wanted = min(lim.default_max_tokens, lim.max_tokens_cap or lim.default_max_tokens)
            wanted = wanted if lim.slide_past_context else min(wanted, room)
            if wanted < 1:
                raise bad_request(f"{where} is {len(prompt)} tokens, the model's whole context ({context}): no room "
                                  "for a new token", "prompt", code="context_length_exceeded")
        else:
            wanted = req.max_tokens
            if not lim.slide_past_context and wanted > room:
                raise bad_request(f"{where} is {len(prompt)} tokens and max_tokens is {wanted}: {len(prompt)} + "
                                  f"{wanted} = {len(prompt) + wanted} is more than the model's context of {context} "
                                  "tokens; lower max_tokens or shorten the prompt", "max_tokens",
                                  code="context_length_exceeded")
        if lim.max_tokens_cap is not None and wanted > lim.max_tokens_cap:
            raise bad_request(f"max_tokens must be at most {lim.max_tokens_cap} (the server's --max-tokens-cap), "
                              f"got {wanted}", "max_tokens")
        if req.min_tokens and req.min_tokens > wanted:
            raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({wanted})", "min_tokens")
        if req.echo and req.logprobs is not None and len(prompt) > context:
            raise bad_request(f"{where} is {len(prompt)} tokens: echo with logprobs scores a prompt in one pass, "
                              f"of at most the model's context ({context} tokens)", "prompt",
                              code="context_length_exceeded")
        return wanted

    def _encode(self, prompt: Any, i: int, n: int) -> list[int]:
        where = "prompt" if n == 1 else f"prompt[{i}]"
        if isinstance(prompt, str):
            if not prompt.strip():
                raise bad_request(f"{where} is empty: give some text to continue", "prompt")
            ids = list(self.model.tokenizer.encode(prompt))
            if not ids:
                raise bad_request(f"{where} encodes to no tokens: give some text to continue", "prompt")
        else:
            ids = list(prompt)
            vocab = self.model.vocab_size
            bad = [t for t in ids if not 0 <= t < (vocab or 2**63)]
            if bad:
                raise bad_request(f"{where} holds token id {bad[0]}, outside the vocabulary [0, {vocab})", "prompt")
        return ids

    async def open(self, req: CompletionRequest) -> "Completion":
        """Check ``req``, submit its rows; raise :class:`APIError` (4xx, or 503 when the engine is down)."""
        plan = await asyncio.to_thread(self.check, req)
        done = Completion(self, req, plan, self.mailbox(asyncio.get_running_loop()))
        await asyncio.to_thread(done.submit, plan.rows)
        return done


class Completion:
    """The rows of one request and the asyncio queue their events arrive on."""

    def __init__(self, service: CompletionService, req: CompletionRequest, plan: Plan, mailbox: LoopMailbox) -> None:
        self.service = service
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = req.model
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.want_logprobs = req.logprobs is not None
        self.n = req.n
        self.prompts = plan.prompts
        self._final_eos_is_text = req.include_stop_str_in_output  # the end-of-text that stops a row
        model = service.model
        tok = model.tokenizer
        skip = [tok.eos_id] if req.skip_special_tokens else []
        self.choices = []
        for i, row in enumerate(plan.rows):
            prompt = next(j for j, p in enumerate(plan.prompts) if p is row["prompt_ids"])
            text = TextAssembler(tok, plan.stops, skip=skip, include_stop=req.include_stop_str_in_output,
                                 min_tokens=req.min_tokens or 0)
            log = LogprobLog(model, row["logprobs"]) if row["logprobs"] is not None else None
            self.choices.append(Choice(i, prompt, row["prompt_ids"], text, plan.texts[prompt] if req.echo else None, log))
        self._echo_logprobs = req.echo and self.want_logprobs
        self._queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self._mailbox = mailbox
        # nobody reads the text before the end (no stream) and no stop string can cut it:
        # the engine thread keeps a row's events and hands them over once, when it finishes,
        # so the event loop (which shares the GIL with the engine) does one wake-up and one
        # decode per row instead of one per token
        self._whole = not req.stream and not plan.stops
        self._held: dict[int, list[Any]] = {}  # request id -> its events so far (engine thread only)
        self._by_request: dict[int, Choice] = {}

    def _sink(self, event: Any) -> None:
        """Called on the engine thread: hand the event to the request's event loop (the
        loop's mailbox wakes it once for all the events of a step: dipaco/serve/mailbox.py);
        a whole completion's row is handed over once, at its end, as a list of its events."""
        if self._whole and event is not ENGINE_FAILED:
            held = self._held.setdefault(event.request_id, [])
            held.append(event)
            if not event.finished:
                return
            event = self._held.pop(event.request_id)
        self._mailbox.post(self._queue, event)

    def submit(self, rows: list[dict[str, Any]]) -> None:
        """One engine request per choice; all or none (a refused one cancels the others)."""
        try:
            for c, settings in zip(self.choices, rows):
                c.request_id = self.service.engine.submit(self.service.make_request(**settings), self._sink)
                self._by_request[c.request_id] = c
        except ValueError as e:  # the engine's own check of a request (one line)
            self.cancel()
            raise bad_request(str(e)) from None
        except EngineDown as e:
            self.cancel()
            raise APIError(503, f"the engine is not running: {e}", code=self.service.engine.down_code) from None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def cancel(self) -> None:
        """Free every row still generating (idempotent)."""
        for c in self.choices:
            if c.request_id >= 0 and c.finish_reason is None:
                self.service.engine.cancel(c.request_id)
                c.finish_reason = c.finish_reason or "cancelled"

    async def updates(self) -> AsyncIterator[tuple[Choice, str, bool]]:
        """``(choice, new text, finished now)`` as tokens arrive, until every choice is done.

        Every event already queued is taken at once and a choice's new text from all of them
        is one update: a stream that fell behind its tokens (the event loop busy with other
        streams) catches up in one chunk instead of one per token, so the loop's work per
        engine step stays one chunk per stream, and the lag cannot grow.

        Raises :class:`APIError` 503 if the engine fails meanwhile.
        """
        while not self.finished:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            pending: dict[int, list] = {}  # choice index -> [choice, text, finished], in order of arrival
            for event in batch:
                if event is ENGINE_FAILED:
                    raise APIError(503, self.service.engine.error or "the engine failed",
                                   code=self.service.engine.down_code)
                update = self._update(event if isinstance(event, list) else [event])
                if update is not None:
                    entry = pending.setdefault(update[0].index, [update[0], "", False])
                    entry[1] += update[1]
                    entry[2] = entry[2] or update[2]
            for c, text, finished in pending.values():
                yield c, text, finished

    def _update(self, events: list[Any]) -> Optional[tuple[Choice, str, bool]]:
        """One choice's update from its events (a whole row at once, or one event)."""
        c = self._by_request.get(events[-1].request_id)
        if c is None or c.finish_reason is not None:
            return None  # a row already cut by a stop string
        _raise_if_failed(events[-1].finish_reason)
        text = self._take(c, events)
        if c.text.stopped:  # a stop string: the row is done here, whatever the engine still makes
            c.finish_reason, c.stop_reason = "stop", c.text.stop_reason
            self.service.engine.cancel(c.request_id)
            return c, text, True
        last = events[-1]
        if last.finished:
            text += c.text.finish()
            c.finish_reason = FINISH_REASONS.get(str(last.finish_reason), str(last.finish_reason))
            c.stop_reason = last.token if last.finish_reason == "stop" else None
        return (c, text, last.finished) if text or last.finished else None

    def _take(self, c: Choice, events: list[Any]) -> str:
        """The text the events made final (the prompt's first, with echo); their tokens,
        paths and log-probabilities recorded. Stops at a stop string."""
        text = ""
        if not c.started:
            c.started = True
            text = c.echo or ""
            if c.logprobs is not None and self._echo_logprobs:
                c.logprobs.add_prompt(c.prompt_ids, events[0].prompt_logprobs)
        tokens = []
        if not c.switches and events[-1].finished and events[-1].token is None and events[-1].path >= 0:
            c.switches.append({"position": len(c.prompt_ids), "path": int(events[-1].path)})  # scored, no token
        for ev in events:
            if ev.token is None:
                continue
            c.tokens += 1
            c.record_path(ev.path)
            if ev.logprob is not None:
                c.cumulative += ev.logprob[0]
            if c.logprobs is not None:
                c.logprobs.add(ev.token, ev.logprob)
            if not (ev.finished and ev.finish_reason == "eos" and not self._final_eos_is_text):
                tokens.append(ev.token)
        return text + c.text.add_all(tokens)

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model_name, "choices": choices}

    def best(self) -> list[Choice]:
        """The choices answered, in order: each prompt's ``n`` likeliest of its rows (all of
        them without ``best_of``), numbered prompt by prompt."""
        out = []
        for p in range(len(self.prompts)):
            mine = [c for c in self.choices if c.prompt == p]
            if len(mine) > self.n:  # best_of: by the sum of the tokens' log-probabilities
                mine = sorted(mine, key=lambda c: -c.cumulative)[:self.n]
            out += mine
        for i, c in enumerate(out):
            c.index = i
        return out

    def response(self) -> dict[str, Any]:
        """The whole completion (``stream: false``), after :meth:`updates` has ended."""
        choices = [{"index": c.index, "text": (c.echo or "") + c.text.text,
                    "logprobs": c.logprobs.whole() if c.logprobs is not None and self.want_logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "dipaco": c.dipaco()}
                   for c in self.best()]
        return {**self._envelope(choices), "usage": self.usage()}

    def chunk(self, choice: Choice, text: str, finished: bool) -> dict[str, Any]:
        """One streamed chunk; the choice's last carries its finish reason and paths."""
        part: dict[str, Any] = {"index": choice.index, "text": text,
                                "logprobs": choice.logprobs.part() if choice.logprobs is not None and self.want_logprobs
                                else None, "finish_reason": choice.finish_reason if finished else None}
        if finished:
            part["stop_reason"] = choice.stop_reason
            part["dipaco"] = choice.dipaco()
        out = self._envelope([part])
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` is set: no choices, the counts."""
        return {**self._envelope([]), "usage": self.usage()}
