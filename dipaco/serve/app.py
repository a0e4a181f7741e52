"""The HTTP app: OpenAI's completions and models endpoints and ``/health``, on FastAPI.

The one module that uses FastAPI / Starlette. Every error a client can cause is OpenAI's
error object with a one-line message (FastAPI's 422 output and Starlette's ``{"detail"}``
are replaced); a body larger than the limit is refused before it is parsed, and the body
is parsed by one parser (:func:`dipaco.serve.schemas.parse_completion`). An exception no
handler expected is a 500 with the error object, caught by one boundary
(:class:`ErrorBoundary`) before it reaches uvicorn, which would drop the connection.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dipaco.serve import sse
from dipaco.serve.completions import Completion, CompletionService
from dipaco.serve.errors import APIError, error_body, one_line
from dipaco.serve.schemas import parse_completion, validation_error

log = logging.getLogger("dipaco.serve")
# how often a non-streaming request checks that its client is still there
_DISCONNECT_POLL_S = 0.25
ENDPOINTS = "POST /v1/completions, GET /v1/models, GET /health"


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
    """ASGI middleware: a request body over ``limit`` bytes gets 413 before anything parses it.

    A declared ``Content-Length`` is checked first; a chunked body is read up to the
    limit and then replayed to the app.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, int(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, 400, "Content-Length is not a number")
            if int(declared) > self.limit:
                return await self._too_large(send, int(declared))
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
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
                          f"{self.limit} (--max-body-bytes)", code="body_too_large")


async def _send_error(send: Send, status: int, message: str, code: str | None = None) -> None:
    response = JSONResponse(error_body(status, message, code=code), status_code=status)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:  # pragma: no cover - JSONResponse never reads
    return {"type": "http.disconnect"}


def create_app(service: CompletionService) -> FastAPI:
    """The app serving ``service``; its lifespan starts and stops the engine thread."""
    model = service.model

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not service.engine.alive:
            service.engine.start()
        yield
        await asyncio.to_thread(service.engine.stop)

    app = FastAPI(title="dipaco-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=service.limits.max_body_bytes)
    app.add_middleware(ErrorBoundary)  # added last: the outermost, so it sees every exception

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
                                "active_requests": engine.active, "engine": vars(engine.stats).copy()}
        loaded = _loaded_paths(engine.engine)
        if loaded is not None:
            body["loaded_paths"] = loaded
        per_engine = _per_engine(engine.engine)
        if per_engine is not None:
            body["engines"] = per_engine
        if not ok:
            body["error"] = engine.error or "the engine thread is not running"
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "dipaco",
                "dipaco": {"num_paths": model.num_paths, **model.info}}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str) -> dict[str, Any]:
        if model_id != model.name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {model.name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        # parsed here, not by FastAPI: one parser for every body (schemas.parse_completion:
        # strict UTF-8 JSON, no lone surrogates, the Content-Type checked)
        body = parse_completion(await request.body(), request.headers.get("content-type"))
        if not service.engine.alive:
            raise APIError(503, f"the engine is not running: {service.engine.error}", code=service.engine.down_code)
        completion = await service.open(body)
        if body.stream:
            return StreamingResponse(_stream(completion), media_type=sse.MEDIA_TYPE, headers=sse.HEADERS)
        return await _collect(completion, request)

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
    """Wait for the whole completion, freeing its rows if the client leaves first."""

    async def drain() -> None:
        async for _ in completion.updates():
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()  # an APIError (engine failed) propagates to its handler
                return JSONResponse(completion.response())
            if await request.is_disconnected():
                log.info("client left %s: freeing its rows", completion.id)
                return Response(status_code=499)
    finally:
        task.cancel()
        completion.cancel()
