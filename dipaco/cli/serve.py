"""``dipaco-serve``: serve a finished run over HTTP with OpenAI's completions API.

    dipaco-serve RUN_DIR [--host H] [--port P] [--served-model-name NAME ...] [--max-loaded-paths N]
                 [--max-batch-size B] [--max-tokens-cap C] [--slide-past-context] [--reroute-every W]
                 [--device D] [--engine-processes N] [--engine-threads T | --engine-in-process] ...

The server's rules (endpoints, continuous batching, refusals, no authentication) are
written once, in :mod:`dipaco.serve`; the inference rules in :mod:`dipaco.inference`; how
it stops and what a client can hold, in :mod:`dipaco.serve.server`. Every way out of
:func:`serve`, an error while starting included, stops the engine processes it started;
they ignore SIGINT and SIGTERM, so a signal to the whole process group (a terminal's
Ctrl-C, systemd, ``timeout``, ``kill -- -PGID``) reaches the server alone, which gives open
requests their grace and then stops them.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import signal
import socket
import sys
from typing import Any, Callable, Optional, Sequence

from dipaco.cli.errors import entry_point, fail, report_user_errors
from dipaco.cli.infer_args import int_in

EXTRA_HINT = 'pip install -e ".[serve]"'
LOOPBACK = "127.0.0.1"
# what to change when the listening socket cannot be bound, by its errno
_BIND_FIX = {errno.EADDRINUSE: "another process has it: choose another --port, or 0 for a free one",
             errno.EADDRNOTAVAIL: "--host is not an address of this machine: try 127.0.0.1 or 0.0.0.0",
             errno.EACCES: "ports below 1024 need privileges: choose --port 1024 or above"}


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
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id requests give and answers carry (default: the run directory's name); "
                        "further names are accepted too")
    p.add_argument("--max-tokens-cap", type=int_in("--max-tokens-cap", 1, 2**20), default=None, metavar="C",
                   help="largest max_tokens a request may ask for (default: none beyond the length rule: prompt + "
                        "max_tokens <= the model's context; with --slide-past-context, 8 contexts)")
    p.add_argument("--slide-past-context", action="store_true",
                   help="accept prompt + max_tokens past the model's context (the model reads the last max_seq_len "
                        "tokens, as dipaco-infer generate and eval do) instead of refusing it (400, as OpenAI)")
    p.add_argument("--max-choices", type=int_in("--max-choices", 1, 65536), default=64, metavar="K",
                   help="choices one request may ask for: its prompts times best_of (or n) (default 64)")
    p.add_argument("--max-stop-strings", type=int_in("--max-stop-strings", 0, 4096), default=32, metavar="S",
                   help="stop strings one request may give (default 32)")
    p.add_argument("--reroute-every", type=int_in("--reroute-every", 1, 2**20), default=None, metavar="W",
                   help="re-route every W tokens (default: route once by the prompt; a request's "
                        "reroute_every field overrides it)")
    p.add_argument("--max-body-bytes", type=int_in("--max-body-bytes", 1024, 2**30), default=1 << 20,
                   metavar="BYTES", help="largest request body accepted (default 1 MiB)")
    p.add_argument("--body-timeout", type=int_in("--body-timeout", 1, 3600), default=30, metavar="S",
                   help="seconds a request body may take to arrive whole (default 30; then 408, connection closed)")
    p.add_argument("--header-timeout", type=int_in("--header-timeout", 1, 3600), default=30, metavar="S",
                   help="seconds a connection may take to send a request's headers (default 30; then closed)")
    p.add_argument("--max-connections", type=int_in("--max-connections", 1, 1 << 20), default=None, metavar="N",
                   help="connections open at once; one more is answered 503 (default 1024, less when the "
                        "process may open fewer files)")
    p.add_argument("--no-access-log", action="store_true", help="no log line per request on stderr")
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
    from dipaco.serve.server import build_server, server_logging

    max_connections = _max_connections(args.max_connections)
    sock = _bind(args.host, args.port)
    if not _is_loopback(args.host):
        _say(f"warning: binding {args.host}: the server has no authentication; anyone who can reach "
             f"port {sock.getsockname()[1]} can use it")
    # SIGTERM while the run opens ends as Ctrl-C does, through the finally below (uvicorn
    # takes both signals over while it serves, and gives them back)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    stops: list[Callable[[], None]] = []  # what stops the engine once it exists: every way out calls it
    try:
        with server_logging(access_log=not args.no_access_log):
            service, ready = _open_service(args, sock, stops)
            server = build_server(service, body_timeout=args.body_timeout, header_timeout=args.header_timeout,
                                  max_connections=max_connections, access_log=not args.no_access_log,
                                  max_batch_size=args.max_batch_size, on_ready=lambda: _say(ready))
            server.run(sockets=[sock])
    except KeyboardInterrupt:
        fail("interrupted while starting: nothing was served", code=130)
    finally:
        for stop in stops:
            stop()  # idempotent: the app's lifespan has usually stopped it already
        signal.signal(signal.SIGTERM, old_term)  # serve() called in a process that goes on (tests)
    _say(f"stopped ({server.stopped_by or 'shut down'})")


def _max_connections(requested: Optional[int]) -> int:
    """``--max-connections``, or its default: 1024, less where the process may open fewer
    files (a connection is a descriptor; the engine pipes and the run's files need some)."""
    from dipaco.serve.server import MAX_CONNECTIONS

    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = -1  # unknown: no bound from it
    room = soft - 64 if soft > 0 else None
    if requested is not None:
        if room is not None and requested > room:
            fail(f"--max-connections {requested} is more than this process can open (its file limit is {soft}, "
                 f"some taken by the engine): give at most {room}, or raise the limit (ulimit -n)")
        return requested
    return max(1, min(MAX_CONNECTIONS, room if room is not None else MAX_CONNECTIONS))


def _interrupt(sig: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _open_service(args: argparse.Namespace, sock: socket.socket, stops: list[Callable[[], None]]) -> tuple[Any, str]:
    """The run opened, its engine started and the service over it (what stops the engine is
    put in ``stops`` as soon as there is one), and the line saying what it serves (said once
    it serves)."""
    from dipaco.inference import InferenceRun
    from dipaco.serve import CompletionService, EngineThread, ServeLimits

    verify = "read" if args.fast_verify else "all"
    shape = {"max_batch_size": args.max_batch_size, "max_loaded_paths": args.max_loaded_paths}
    if args.engine_in_process:
        run = InferenceRun.open(args.run_dir, checkpoint=args.checkpoint, device=args.device, verify=verify)
        model = _model(run, args)
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
        model = _model(run, args, checkpoint=engine.info["checkpoint"])
    cap = args.max_tokens_cap
    if cap is None and args.slide_past_context:  # a request still bounds its rows' work
        cap = 8 * model.max_seq_len
    limits = ServeLimits(max_tokens_cap=cap, max_body_bytes=args.max_body_bytes, reroute_every=args.reroute_every,
                         max_choices=args.max_choices, max_stop_strings=args.max_stop_strings,
                         slide_past_context=args.slide_past_context)
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
    length = (f"prompt + max_tokens may pass the context (max_tokens <= {cap})" if args.slide_past_context else
              "prompt + max_tokens <= the context" + (f", max_tokens <= {cap}" if cap is not None else ""))
    return service, (f"serving model {model.name!r} ({model.num_paths} paths, context {model.max_seq_len} tokens) "
                     f"on http://{_url_host(host)}:{port}/v1 (at most {args.max_loaded_paths} path(s) loaded, "
                     f"batches of {args.max_batch_size}, {length}; engine {where})")


def _model(run: Any, args: argparse.Namespace, checkpoint: Optional[str] = None) -> Any:
    from dipaco.serve import ServedModel

    names = args.served_model_name or [None]
    return ServedModel.from_run(run, name=names[0], checkpoint=checkpoint, aliases=names[1:])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Console-script entry point (argument errors and failures as one line: dipaco.cli.errors)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return serve(args)


if __name__ == "__main__":
    main(sys.argv[1:])
