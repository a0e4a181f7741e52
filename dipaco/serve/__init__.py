"""``dipaco-serve``: an OpenAI-compatible HTTP server over the batched routed engine.

    model = ServedModel.from_run(run)                        # name, tokenizer, context
    thread = EngineThread(EngineProcess.start(EngineSpec(run_dir), vocab_size))  # or RoutedEngine(run)
    app = create_app(CompletionService(model, thread, ServeLimits(max_tokens_cap=256)))

Rules, written once here and referred to by ``dipaco-serve --help`` and docs/serving.md:

* **Endpoints.** ``POST /v1/completions`` (OpenAI's schema; ``n`` = 1 per prompt, a list
  of prompts gives one choice each; ``stream`` sends server-sent events ending with
  ``data: [DONE]``), ``GET /v1/models`` (the run as one model, named after its
  directory), ``GET /health`` (200 while the engine thread runs, 503 once it failed).
  Each choice also says which paths made it: ``"dipaco": {"paths", "switches"}``.
* **Continuous batching.** One engine thread (:class:`EngineThread`) runs
  ``engine.step()`` while there is work; a new request is queued by the engine on its
  path and joins that path's running batch at the next step. At most
  ``--max-loaded-paths`` paths are in memory (the engine's bound).
* **The engine in processes of its own.** ``dipaco-serve`` runs the engine in spawned
  processes (:class:`~dipaco.serve.engine_process.EngineProcess`, the same API), so the
  HTTP loop and the engine's Python never wait for one GIL. On a CPU there is one per
  core (``--engine-processes``), one thread each, at most one per path; the server routes
  each request and keeps a path's open requests in one of them, so its batches stay
  whole (:class:`~dipaco.serve.engine_pool.EnginePool`). One process takes every core
  but one (``--engine-threads``). ``--engine-in-process`` keeps one process.
* **Refusals.** Every refusal is OpenAI's error object with a one-line message and a
  4xx status (413 for a body over ``--max-body-bytes``, checked before parsing; 404 for
  an unknown model; 415 for a body not sent as JSON; 400 for the rest), or 503 while the
  engine is down; never a traceback (a bug is a 500 with the same object, its traceback in
  the log). Every body goes through one parser (``schemas.parse_completion``). Types are
  strict and unknown fields are refused.
* **Stop strings** cut the text before the stop (which is not returned) and free the
  row in the engine; a client that disconnects frees its rows too.
* **Stopping** (``dipaco/cli/serve.py``). A signal gives open requests a grace period, then
  answers those left 503 (``EngineThread.refuse_open``); the engine processes are stopped on
  every way out; exit 0.
* **No authentication.** The server binds 127.0.0.1 unless told otherwise; anyone who
  can reach its port can use it.
"""
from __future__ import annotations

from dipaco.serve.completions import CompletionService
from dipaco.serve.engine_pool import EnginePool
from dipaco.serve.engine_process import EngineFailed, EngineProcess, EngineSpec
from dipaco.serve.engine_thread import EngineDown, EngineThread
from dipaco.serve.errors import APIError
from dipaco.serve.model import ServedModel, ServeLimits

__all__ = ["CompletionService", "EngineThread", "EngineDown", "EnginePool", "EngineProcess", "EngineSpec",
           "EngineFailed", "APIError", "ServedModel", "ServeLimits"]
