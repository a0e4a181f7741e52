"""One ``POST /v1/completions`` request in flight, free of any web framework.

:meth:`CompletionService.open` checks a parsed request against the model and the limits,
encodes its prompts and submits one engine request per prompt (one choice each);
:meth:`Completion.updates` yields each choice's new text as tokens arrive, cutting at stop
strings (the engine row is cancelled then); :meth:`Completion.response` and
:meth:`Completion.chunk` shape OpenAI's objects. :meth:`Completion.cancel` frees every row
still generating (a client that left).
"""
from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from dipaco.serve.engine_thread import ENGINE_FAILED, EngineDown, EngineThread
from dipaco.serve.errors import APIError, bad_request
from dipaco.serve.mailbox import LoopMailbox
from dipaco.serve.model import ServedModel, ServeLimits
from dipaco.serve.schemas import CompletionRequest, check_sampling, prompts_of, stops_of
from dipaco.serve.text import TextAssembler

# the engine's finish reasons in OpenAI's words (a full context is a length limit too)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def _raise_if_failed(reason: Any) -> None:
    """A row the engine ended with ``error: ...`` (a damaged checkpoint file of its path:
    that path fails, the engine goes on) is a 500 naming the file."""
    if str(reason).startswith("error: "):
        raise APIError(500, str(reason)[len("error: "):], code="checkpoint_error")


def engine_request(**fields: Any) -> Any:
    """An engine :class:`~dipaco.inference.engine.Request` (imported late: the engine is heavy)."""
    from dipaco.inference.engine import Request

    return Request(**fields)


@dataclass
class Choice:
    """One prompt's row: its engine request, text so far, paths used, finish reason."""

    index: int
    prompt_ids: list[int]
    text: TextAssembler
    request_id: int = -1
    tokens: int = 0
    switches: list[dict[str, int]] = field(default_factory=list)
    finish_reason: Optional[str] = None

    def record_path(self, path: int) -> None:
        """Note the path that generated the latest token (a switch when it changed)."""
        if not self.switches or self.switches[-1]["path"] != path:
            self.switches.append({"position": len(self.prompt_ids) + self.tokens - 1, "path": int(path)})

    def dipaco(self) -> dict[str, Any]:
        """This server's extension of a choice: the paths it used, in order, and where each began."""
        return {"paths": [s["path"] for s in self.switches], "switches": list(self.switches)}


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

    def check(self, req: CompletionRequest) -> tuple[list[list[int]], dict[str, Any], list[str]]:
        """Prompts as token ids, the engine request's settings and the stop strings; or an :class:`APIError`."""
        if req.model != self.model.name:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {self.model.name!r} "
                           "(GET /v1/models)", param="model", code="model_not_found")
        check_sampling(req)
        lim = self.limits
        max_tokens = min(lim.default_max_tokens, lim.max_tokens_cap) if req.max_tokens is None else req.max_tokens
        if not 1 <= max_tokens <= lim.max_tokens_cap:
            raise bad_request(f"max_tokens must lie in [1, {lim.max_tokens_cap}] (the server's --max-tokens-cap), "
                              f"got {max_tokens}", "max_tokens")
        stops = stops_of(req.stop)
        prompts = prompts_of(req.prompt)
        if len(prompts) > lim.max_prompts:
            raise bad_request(f"prompt holds {len(prompts)} prompts; at most {lim.max_prompts} per request", "prompt")
        ids = [self._encode(p, i, len(prompts)) for i, p in enumerate(prompts)]
        settings = {"max_new_tokens": max_tokens, "temperature": 1.0 if req.temperature is None else float(req.temperature),
                    "top_k": req.top_k, "top_p": None if req.top_p in (None, 1) else float(req.top_p),
                    "seed": secrets.randbits(32) if req.seed is None else req.seed, "stop_at_eos": True,
                    "reroute_every": lim.reroute_every if req.reroute_every is None else req.reroute_every}
        return ids, settings, stops

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
        limit = self.model.max_seq_len
        if len(ids) >= limit:
            raise bad_request(f"{where} is {len(ids)} tokens; the model's context is {limit} tokens, so a prompt "
                              f"may hold at most {limit - 1} (one new token needs room)", "prompt",
                              code="context_length_exceeded")
        return ids

    async def open(self, req: CompletionRequest) -> "Completion":
        """Check ``req``, submit its rows; raise :class:`APIError` (4xx, or 503 when the engine is down)."""
        ids, settings, stops = await asyncio.to_thread(self.check, req)
        done = Completion(self, req, ids, stops, self.mailbox(asyncio.get_running_loop()))
        await asyncio.to_thread(done.submit, settings)
        return done


class Completion:
    """The rows of one request and the asyncio queue their events arrive on."""

    def __init__(self, service: CompletionService, req: CompletionRequest, prompts: list[list[int]],
                 stops: list[str], mailbox: LoopMailbox) -> None:
        self.service = service
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        tok = service.model.tokenizer
        self.choices = [Choice(i, p, TextAssembler(tok, stops, tok.eos_id)) for i, p in enumerate(prompts)]
        self._queue: "asyncio.Queue[Any]" = asyncio.Queue()
        self._mailbox = mailbox
        # nobody reads the text before the end (no stream) and no stop string can cut it:
        # the engine thread keeps a row's events and hands them over once, when it finishes,
        # so the event loop (which shares the GIL with the engine) does one wake-up and one
        # decode per row instead of one per token
        self._whole = not req.stream and not stops
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

    def submit(self, settings: dict[str, Any]) -> None:
        """One engine request per prompt; all or none (a refused one cancels the others)."""
        try:
            for c in self.choices:
                request = self.service.make_request(prompt_ids=c.prompt_ids, **settings)
                c.request_id = self.service.engine.submit(request, self._sink)
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

        Raises :class:`APIError` 503 if the engine fails meanwhile.
        """
        while not self.finished:
            event = await self._queue.get()
            if event is ENGINE_FAILED:
                raise APIError(503, self.service.engine.error or "the engine failed", code=self.service.engine.down_code)
            if isinstance(event, list):  # a whole row at once (no stream, no stop string)
                update = self._whole_row(event)
                if update is not None:
                    yield update
                continue
            c = self._by_request.get(event.request_id)
            if c is None or c.finish_reason is not None:
                continue  # a row already cut by a stop string
            text = ""
            if event.token is not None:
                c.tokens += 1
                c.record_path(event.path)
                text = c.text.add(event.token)
                if c.text.stopped:
                    c.finish_reason = "stop"
                    self.service.engine.cancel(c.request_id)
                    yield c, text, True
                    continue
            if event.finished:
                _raise_if_failed(event.finish_reason)
                text += c.text.finish()
                c.finish_reason = FINISH_REASONS.get(str(event.finish_reason), str(event.finish_reason))
            if text or event.finished:
                yield c, text, event.finished

    def _whole_row(self, events: list[Any]) -> Optional[tuple[Choice, str, bool]]:
        """The update of a row handed over whole: its tokens and paths, one decode."""
        c = self._by_request.get(events[-1].request_id)
        if c is None or c.finish_reason is not None:
            return None
        tokens = []
        for ev in events:
            if ev.token is not None:
                c.tokens += 1
                c.record_path(ev.path)
                tokens.append(ev.token)
        last = events[-1]
        _raise_if_failed(last.finish_reason)
        text = c.text.add_all(tokens) + c.text.finish()
        c.finish_reason = FINISH_REASONS.get(str(last.finish_reason), str(last.finish_reason))
        return c, text, True

    def usage(self) -> dict[str, int]:
        prompt = sum(len(c.prompt_ids) for c in self.choices)
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.service.model.name, "choices": choices}

    def response(self) -> dict[str, Any]:
        """The whole completion (``stream: false``), after :meth:`updates` has ended."""
        choices = [{"index": c.index, "text": c.text.text, "logprobs": None, "finish_reason": c.finish_reason,
                    "dipaco": c.dipaco()} for c in self.choices]
        return {**self._envelope(choices), "usage": self.usage()}

    def chunk(self, choice: Choice, text: str, finished: bool) -> dict[str, Any]:
        """One streamed chunk; the choice's last carries its finish reason and paths."""
        part: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": None,
                                "finish_reason": choice.finish_reason if finished else None}
        if finished:
            part["dipaco"] = choice.dipaco()
        out = self._envelope([part])
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage`` is set: no choices, the counts."""
        return {**self._envelope([]), "usage": self.usage()}
