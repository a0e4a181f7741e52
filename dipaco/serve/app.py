"""The HTTP app: OpenAI's completions and models endpoints, vLLM's tokenizer endpoints,
``/metrics`` and ``/health``, on FastAPI.

The one module that uses FastAPI / Starlette. Every error a client can cause is OpenAI's
error object with a one-line message (FastAPI's 422 output and Starlette's ``{"detail"}``
are replaced); a body larger than the limit is refused before it is parsed, one that does
not arrive in time is dropped (408), and every body is parsed by one parser
(:func:`dipaco.serve.schemas.parse_body`). An exception no handler expected is a 500 with
the error object, caught by one boundary (:class:`ErrorBoundary`) before it reaches
uvicorn, which would drop the connection.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dipaco.serve import sse
from dipaco.serve.completions import Completion, CompletionService
from dipaco.serve.errors import APIError, bad_request, error_body, one_line
from dipaco.serve.metrics import HttpMetrics, HttpObserver, render
from dipaco.serve.schemas import (CompletionRequest, DetokenizeRequest, TokenizeRequest, parse_body,
                                  validation_error)

log = logging.getLogger("dipaco.serve")
ENDPOINTS = ("POST /v1/completions, GET /v1/models, POST /tokenize, POST /detokenize, GET /tokenizer_info, "
             "GET /metrics, GET /health")
BODY_TIMEOUT_S = 30.0
# a refusal before the whole body was read: the connection is closed after it (the rest of
# the body would otherwise be read as the next request, or hold the connection)
_CLOSE = {"connection": "close"}


class ErrorBoundary:
    """ASGI middleware: an exception that reaches it is logged with its traceback and answered
    500 with the error object (if the response has not started), and goes no further.

    Why here and not in an ``Exception`` handler: Starlette sends that handler's response
    and then re-raises, and uvicorn closes the connection, so a keep-alive client's next
    request on it failed with a reset. A streamed response that already started cannot
    change its status: it ends there (its rows are freed by its own ``finally``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:  # noqa: BLE001 - the boundary: nothing passes it
            log.exception("internal error")  # the traceback stays in the server's log
            if not started:
                await _send_error(send, 500, f"internal error: {type(e).__name__}: {one_line(str(e))}")


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before anything parses it,
    and one that has not arrived whole ``timeout`` seconds after its headers gets 408; the
    connection is then closed (a client trickling a body cannot hold it).

    A declared ``Content-Length`` is checked first; a chunked body is read up to the
    limit and then replayed to the app.
    """

    def __init__(self, app: ASGIApp, limit: int, timeout: float = BODY_TIMEOUT_S) -> None:
        self.app, self.limit, self.timeout = app, int(limit), float(timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, 400, "Content-Length is not a number", headers=_CLOSE)
            if int(declared) > self.limit:
                return await self._too_large(send, int(declared))
        chunks, size, more = [], 0, True
        deadline = time.monotonic() + self.timeout
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return await _send_error(send, 408, f"the request body did not arrive whole within {self.timeout:g} s "
                                         f"({size} bytes came); the connection is closed", code="body_timeout",
                                         headers=_CLOSE)
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                return await self._too_large(send, size)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        await _send_error(send, 413, f"the request body is {size}+ bytes; this server accepts at most "
                          f"{self.limit} (--max-body-bytes)", code="body_too_large", headers=_CLOSE)


async def _send_error(send: Send, status: int, message: str, code: str | None = None,
                      headers: Optional[dict[str, str]] = None) -> None:
    response = JSONResponse(error_body(status, message, code=code), status_code=status, headers=headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return {"type": "http.disconnect"}


def create_app(service: CompletionService, *, body_timeout: float = BODY_TIMEOUT_S, access_log: bool = True,
               max_batch_size: Optional[int] = None, on_ready: Optional[Callable[[], None]] = None) -> FastAPI:
    """The app serving ``service``; its lifespan starts and stops the engine thread.

    ``access_log``: a line per request on the ``dipaco.serve.access`` logger;
    ``max_batch_size``: the engine's, for ``/metrics``' batch occupancy; ``on_ready``: called
    once the server serves (its stop signals handled: ``dipaco-serve`` says so then)."""
    model = service.model
    http = HttpMetrics()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not service.engine.alive:
            service.engine.start()
        if on_ready is not None:
            on_ready()
        yield
        await asyncio.to_thread(service.engine.stop)

    app = FastAPI(title="dipaco-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=service.limits.max_body_bytes, timeout=body_timeout)
    app.add_middleware(ErrorBoundary)  # the outermost but one, so it sees every exception
    app.add_middleware(HttpObserver, metrics=http, enabled=access_log)  # outermost: sees every status, 500s too
    app.state.http_metrics = http

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(e.errors())
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = str(e.detail)
        if e.status_code in (404, 405):
            message = (f"{request.method} {request.url.path}: {message.lower()}; this server answers "
                       f"{ENDPOINTS}")
        return JSONResponse(error_body(e.status_code, message), status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = service.engine
        ok = engine.alive
        body: dict[str, Any] = {"status": "ok" if ok else "failed", "model": model.name,
                                "active_requests": engine.active, "engine": engine.stats.health()}
        loaded = _loaded_paths(engine.engine)
        if loaded is not None:
            body["loaded_paths"] = loaded
        per_engine = _per_engine(engine.engine)
        if per_engine is not None:
            body["engines"] = per_engine
        if not ok:
            body["error"] = engine.error or "the engine thread is not running"
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(render(http, service.engine, max_batch_size, model.name),
                                 media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": model.created, "owned_by": "dipaco",
                "root": model.name, "max_model_len": model.max_seq_len,
                "dipaco": {"num_paths": model.num_paths, **model.info}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in model.names]}

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str) -> dict[str, Any]:
        service.check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        # parsed here, not by FastAPI: one parser for every body (schemas.parse_body:
        # strict UTF-8 JSON, no lone surrogates, the Content-Type checked)
        body = parse_body(CompletionRequest, await request.body(), request.headers.get("content-type"))
        if not service.engine.alive:
            raise APIError(503, f"the engine is not running: {service.engine.error}", code=service.engine.down_code)
        completion = await service.open(body)
        request.state.completion = completion  # its token counts, for the access log
        if body.stream:
            return StreamingResponse(_stream(completion), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        return await _collect(completion, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await request.body(), request.headers.get("content-type"))
        service.check_model(body.model)
        ids = await asyncio.to_thread(model.tokenizer.encode, body.prompt)
        return {"count": len(ids), "max_model_len": model.max_seq_len, "tokens": list(ids),
                "token_strs": [model.token_text(t) for t in ids] if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await request.body(), request.headers.get("content-type"))
        service.check_model(body.model)
        vocab = model.vocab_size or 2**63
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens holds token id {bad[0]}, outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await asyncio.to_thread(model.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        # what lm-eval's remote tokenizer (tokenizer_backend=auto) reads, with /tokenize and /detokenize
        return {"tokenizer_class": type(model.tokenizer).__name__, "eos_token": model.eos_text,
                "bos_token": None, "pad_token": None, "model_max_length": model.max_seq_len,
                "vocab_size": model.vocab_size}

    return app


def _loaded_paths(engine: Any) -> list[int] | None:
    """Paths the engine holds in memory, if it says (its own list, or its path loader's)."""
    for holder in (engine, getattr(engine, "loader", None)):
        loaded = getattr(holder, "loaded_paths", None)
        if isinstance(loaded, (list, tuple)):
            return [int(p) for p in loaded]
    return None


def _per_engine(engine: Any) -> list[dict[str, Any]] | None:
    """Each engine process's open requests and loaded paths, when the engine is a pool of them."""
    open_per_engine = getattr(engine, "open_per_engine", None)
    if not callable(open_per_engine):
        return None
    return [{"open_requests": n, "loaded_paths": [int(p) for p in e.loaded_paths]}
            for n, e in zip(open_per_engine(), engine.engines)]


async def _stream(completion: Completion) -> AsyncIterator[str]:
    """The chunks of a streamed completion; rows still generating are freed however it ends."""
    try:
        async for choice, text, finished in completion.updates():
            yield sse.event(completion.chunk(choice, text, finished))
        if completion.include_usage:
            yield sse.event(completion.usage_chunk())
    except APIError as e:  # the engine failed mid-stream: the status line is gone, say it in the stream
        yield sse.event(e.body())
    finally:
        completion.cancel()  # a client that disconnected lands here too (the task is cancelled)
    yield sse.DONE


async def _collect(completion: Completion, request: Request) -> Response:
    """Wait for the whole completion, freeing its rows as soon as the client leaves (its
    connection's close is awaited, not polled for)."""

    async def drain() -> None:
        async for _ in completion.updates():
            pass

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, left = asyncio.ensure_future(drain()), asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, left}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # an APIError (engine failed) propagates to its handler
            return JSONResponse(completion.response())
        log.info("client left %s: freeing its rows", completion.id)
        return Response(status_code=499)
    finally:
        task.cancel()
        left.cancel()
        completion.cancel()
