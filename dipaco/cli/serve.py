"""``dipaco-serve``: serve a finished run over HTTP with OpenAI's completions API.

    dipaco-serve RUN_DIR [--host H] [--port P] [--max-loaded-paths N] [--max-batch-size B]
                 [--max-tokens-cap C] [--reroute-every W] [--device D]
                 [--engine-processes N] [--engine-threads T | --engine-in-process]

The server's rules (endpoints, continuous batching, refusals, no authentication) are
written once, in :mod:`dipaco.serve`; the inference rules in :mod:`dipaco.inference`.
The one module that uses uvicorn.

How it stops (:func:`build_server`): SIGTERM or SIGINT stops accepting connections and
gives open requests ``GRACE_S`` seconds to finish; those still open then get a 503 saying
the server is stopping (a stream: an error event, then ``[DONE]``) rather than a cut
connection. The process prints ``stopped (SIGTERM)`` and exits 0; a second SIGINT ends
the grace at once (the same 503s), a third stops without answering. Every way out of
:func:`serve`, an error while starting included, stops the engine processes it started.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import signal
import socket
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from dipaco.cli.errors import entry_point, fail, report_user_errors
from dipaco.cli.infer_args import int_in

EXTRA_HINT = 'pip install -e ".[serve]"'
LOOPBACK = "127.0.0.1"
# what to change when the listening socket cannot be bound, by its errno
_BIND_FIX = {errno.EADDRINUSE: "another process has it: choose another --port, or 0 for a free one",
             errno.EADDRNOTAVAIL: "--host is not an address of this machine: try 127.0.0.1 or 0.0.0.0",
             errno.EACCES: "ports below 1024 need privileges: choose --port 1024 or above"}
# seconds a stop signal leaves open requests to finish before they are answered 503
GRACE_S = 5.0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (exit 2), like every dipaco command."""

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The ``dipaco-serve`` argument parser."""
    p = _Parser(prog="dipaco-serve", description=(
        "Serve a finished dipaco-train run with OpenAI's completions API (POST /v1/completions, "
        "GET /v1/models, GET /health): each prompt is routed to one path and decoded in that "
        "path's batch, which new requests join at its next step."), epilog=(
        "There is no authentication: the server binds 127.0.0.1 unless --host says otherwise, "
        "and anyone who can reach its port can use it. The checkpoint is hash-checked when the "
        "run is opened (--fast-verify: only the module files read). Rules: docs/serving.md."))
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished dipaco-train run directory")
    p.add_argument("--host", default=LOOPBACK, help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_in("--port", 0, 65535), default=8000,
                   help="TCP port (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--max-loaded-paths", type=int_in("--max-loaded-paths", 1, 4096), default=1, metavar="N",
                   help="paths kept in memory at once, by each engine process (default 1)")
    p.add_argument("--max-batch-size", type=int_in("--max-batch-size", 1, 4096), default=32, metavar="B",
                   help="rows decoded together in one path's batch (default 32)")
    p.add_argument("--max-tokens-cap", type=int_in("--max-tokens-cap", 1, 2**20), default=None, metavar="C",
                   help="largest max_tokens a request may ask for (default: the model's context)")
    p.add_argument("--reroute-every", type=int_in("--reroute-every", 1, 2**20), default=None, metavar="W",
                   help="re-route every W tokens (default: route once by the prompt; a request's "
                        "reroute_every field overrides it)")
    p.add_argument("--max-body-bytes", type=int_in("--max-body-bytes", 1024, 2**30), default=1 << 20,
                   metavar="BYTES", help="largest request body accepted (default 1 MiB)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default=None,
                   help="where the path models run (default: the run's trainer.device)")
    p.add_argument("--checkpoint", default=None, metavar="ROUND",
                   help="round number, round_NNNNNN name or path (default: newest)")
    p.add_argument("--fast-verify", action="store_true",
                   help="hash only the module files read, not the whole checkpoint")
    p.add_argument("--engine-processes", type=int_in("--engine-processes", 1, 256), default=None, metavar="N",
                   help="engine processes, each taking the requests of the paths it serves (default on a CPU: one "
                        "per core, of one thread each, at most one per path; on a GPU: one); each keeps its "
                        "own --max-loaded-paths")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--engine-threads", type=int_in("--engine-threads", 1, 4096), default=None, metavar="T",
                       help="torch threads of each engine process (default: 1 when there are several; one "
                            "process takes all cores but one, which the HTTP loop and its clients use; on a GPU "
                            "torch's default)")
    where.add_argument("--engine-in-process", action="store_true",
                       help="step the engine on a thread of the server's process instead of a process of its "
                            "own (one process; the HTTP loop then shares its GIL: slower under load)")
    return p


def _require_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        fail(f"dipaco-serve needs the serve extra ({e.name} is missing): {EXTRA_HINT}")


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the run is loaded (a busy port fails at once)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        fail(f"--host {host!r} is not an address of this machine ({e.strerror})")
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        fail(f"cannot listen on {host}:{port}: {e.strerror} ({_BIND_FIX.get(e.errno, 'check --host and --port')})")
    sock.listen(2048)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _say(message: str) -> None:
    print(f"dipaco-serve: {message}", file=sys.stderr, flush=True)


@report_user_errors
def serve(args: argparse.Namespace) -> None:
    """Open the run, start the engine, serve until a signal; every way out stops the engine."""
    _require_extra()
    if args.engine_in_process and args.engine_processes is not None:
        fail("--engine-processes is not allowed with --engine-in-process (see dipaco-serve --help)")
    sock = _bind(args.host, args.port)
    if not _is_loopback(args.host):
        _say(f"warning: binding {args.host}: the server has no authentication; anyone who can reach "
             f"port {sock.getsockname()[1]} can use it")
    # SIGTERM while the run opens ends as Ctrl-C does, through the finally below (uvicorn
    # takes both signals over while it serves, and gives them back)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    stops: list[Callable[[], None]] = []  # what stops the engine once it exists: every way out calls it
    try:
        service = _open_service(args, sock, stops)
        server = build_server(service)
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        fail("interrupted while starting: nothing was served", code=130)
    finally:
        for stop in stops:
            stop()  # idempotent: the app's lifespan has usually stopped it already
        signal.signal(signal.SIGTERM, old_term)  # serve() called in a process that goes on (tests)
    _say(f"stopped ({server.stopped_by or 'shut down'})")


def _interrupt(sig: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _open_service(args: argparse.Namespace, sock: socket.socket, stops: list[Callable[[], None]]) -> Any:
    """The run opened, its engine started and the service over it (what stops the engine is
    put in ``stops`` as soon as there is one); says what it serves on stderr."""
    from dipaco.inference import InferenceRun
    from dipaco.serve import CompletionService, EngineThread, ServedModel, ServeLimits

    verify = "read" if args.fast_verify else "all"
    shape = {"max_batch_size": args.max_batch_size, "max_loaded_paths": args.max_loaded_paths}
    if args.engine_in_process:
        run = InferenceRun.open(args.run_dir, checkpoint=args.checkpoint, device=args.device, verify=verify)
        model = ServedModel.from_run(run)
        from dipaco.inference.engine import RoutedEngine  # after the quick checks: it imports torch kernels

        engine: Any = RoutedEngine(run, **shape)
        stops.append(engine.close)
    else:  # the weights are opened (and verified) by the process that reads them
        run = InferenceRun.open(args.run_dir, device=args.device, need_weights=False)
        from dipaco.serve.engine_pool import EnginePool, engine_processes
        from dipaco.serve.engine_process import EngineFailed, EngineProcess, EngineSpec

        if args.engine_processes is not None and args.engine_processes > run.num_paths:
            # a path's requests go to one engine at a time: engines past the paths would only
            # hold memory (about 320 MiB each on the default run)
            fail(f"--engine-processes {args.engine_processes} is more than the run's {run.num_paths} paths; "
                 f"give at most {run.num_paths}")
        n = engine_processes(args.engine_processes, str(args.device or run.cfg.trainer.device), run.num_paths)
        threads = args.engine_threads if args.engine_threads is not None or n == 1 else 1
        spec = EngineSpec(str(args.run_dir), checkpoint=args.checkpoint, verify=verify, device=args.device,
                          engine=shape, threads=threads)
        try:
            engine = EngineProcess.start(spec, int(run.cfg.model.vocab_size)) if n == 1 else \
                EnginePool.start([spec] * n, int(run.cfg.model.vocab_size), route=run.route)
        except EngineFailed as e:
            fail(str(e))
        stops.append(engine.close)
        model = ServedModel.from_run(run, checkpoint=engine.info["checkpoint"])
    cap = model.max_seq_len if args.max_tokens_cap is None else args.max_tokens_cap
    limits = ServeLimits(max_tokens_cap=cap, max_body_bytes=args.max_body_bytes, reroute_every=args.reroute_every)
    thread = EngineThread(engine)
    stops[:] = [thread.stop]  # the thread's stop closes the engine too (and ends a thread still stepping)
    service = CompletionService(model, thread, limits)
    host, port = sock.getsockname()[:2]
    if args.engine_in_process:
        where = "in this process"
    elif engine.info.get("processes", 1) > 1:
        where = f"in {engine.info['processes']} processes of {engine.info['threads']} thread(s), paths kept apart"
    else:
        where = f"in its own process, {engine.info['threads']} thread(s)"
    _say(f"serving model {model.name!r} ({model.num_paths} paths, context {model.max_seq_len} tokens) on "
         f"http://{_url_host(host)}:{port}/v1 (at most {args.max_loaded_paths} path(s) loaded, batches of "
         f"{args.max_batch_size}, max_tokens <= {cap}; engine {where})")
    return service


def build_server(service: Any, *, grace: float = GRACE_S) -> Any:
    """uvicorn's server for ``service`` with dipaco-serve's stop rule (module docstring).

    ``stopped_by`` is the name of the signal that stopped it (``None`` until one came).
    Why not uvicorn's own rule: past its grace it cancels the requests' tasks, so a client
    got a bare ``500 Internal Server Error`` in plain text or a stream cut without
    ``[DONE]`` (and the log a traceback per request); and it re-raises the signal once
    stopped, so a clean stop by SIGTERM exited -15 and SIGINT as a Ctrl-C of training.
    """
    import uvicorn

    from dipaco.serve.app import create_app

    class Server(uvicorn.Server):
        stopped_by: Optional[str] = None

        def handle_exit(self, sig: int, frame: Any) -> None:  # uvicorn's, without re-raising the signal
            if self.should_exit:  # a second Ctrl-C ends the grace now, a third stops waiting at all
                if sig == signal.SIGINT:
                    self.force_exit = self.hurried
                    self.hurried = True
                    service.engine.refuse_open(self.reason)
                return
            self.should_exit, self.hurried = True, False
            self.stopped_by = signal.Signals(sig).name
            self.reason = f"the server is shutting down ({self.stopped_by}); send the request again once it is back"
            timer = threading.Timer(grace, service.engine.refuse_open, args=(self.reason,))
            timer.daemon = True  # the process may end first: nothing was left open
            timer.start()

    # uvicorn's own limit comes after ours, so the 503s are written before it cancels anything
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + 5)
    return Server(config)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Console-script entry point (argument errors and failures as one line: dipaco.cli.errors)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(args)


if __name__ == "__main__":
    main(sys.argv[1:])
