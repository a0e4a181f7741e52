"""``dipaco-serve``: an OpenAI-compatible HTTP server over the batched routed engine.

    model = ServedModel.from_run(run)                        # name, tokenizer, context
    thread = EngineThread(EngineProcess.start(EngineSpec(run_dir), vocab_size))  # or RoutedEngine(run)
    app = create_app(CompletionService(model, thread, ServeLimits()))

Rules, written once here and referred to by ``dipaco-serve --help`` and docs/serving.md:

* **Endpoints.** ``POST /v1/completions`` (OpenAI's schema with vLLM's sampling extras:
  ``n``/``best_of`` rows per prompt, seeded apart; ``logprobs`` and ``echo`` as OpenAI's
  ``logprobs`` object; ``stream`` sends server-sent events ending with ``data: [DONE]``),
  ``GET /v1/models`` (the run, under each served name, with ``max_model_len``),
  ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info`` (vLLM's shapes),
  ``GET /metrics`` (Prometheus' text format), ``GET /health`` (200 while the engine
  thread runs, 503 once it failed). Each choice also says which paths made it:
  ``"dipaco": {"paths", "switches"}``.
* **One length rule**, OpenAI's: a prompt and its ``max_tokens`` fit in the context, else
  400 naming both; the default ``max_tokens`` (16) is lowered to what fits. Past the
  context only with ``--slide-past-context``.
* **Routing.** Each prompt is routed by its own first routing-prefix tokens, whatever it
  holds: a context + continuation sent as one prompt (lm-eval's ``echo`` scoring) is
  routed on its start, where ``dipaco-infer eval`` routes the context alone; they agree
  when the context holds the prefix.
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
  4xx status (413 for a body over ``--max-body-bytes``, checked before parsing; 408 for a
  body or headers not whole in time; 404 for an unknown model; 415 for a body not sent as
  JSON; 400 for the rest), or 503 while the engine is down or the connections are at
  ``--max-connections``; never a traceback (a bug is a 500 with the same object, its
  traceback in the log). Every body goes through one parser (``schemas.parse_body``);
  every field and the domain of every number are declared in :mod:`dipaco.serve.schemas`.
  Types are strict and unknown fields are refused.
* **Stop strings** cut the text before the stop (which is not returned) and free the
  row in the engine; a client that disconnects frees its rows too, within a few tokens
  (a stream behind its tokens catches up in one chunk; an engine process stays at most 8
  steps ahead of the server).
* **Stopping** (:mod:`dipaco.serve.server`). A signal, to the server or its whole process
  group, gives open requests a grace period, then answers those left 503
  (``EngineThread.refuse_open``); the engine processes ignore the signal and are stopped
  by the server on every way out; exit 0.
* **Bounds and logs** (:mod:`dipaco.serve.server`, :mod:`dipaco.serve.metrics`):
  connections capped, headers and bodies timed out; an access line per request; each
  kind of warning or error logged once per interval.
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
