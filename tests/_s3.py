"""A local S3 endpoint for the tests: moto's S3 served over HTTP from a thread of the
test process, reached through s3fs exactly as a user reaches MinIO, Ceph or R2.

``s3`` (a fixture: ``from _s3 import s3``) gives each test a fresh bucket and the
standard AWS environment variables, set for the test and inherited by the processes it
starts (decoupled workers, a CLI in a subprocess):

* ``AWS_ENDPOINT_URL_S3``: botocore's per-service endpoint variable, which s3fs honours
  through aiobotocore; dipaco passes nothing of its own.
* ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``: any value (moto checks none);
  ``AWS_DEFAULT_REGION``; ``AWS_EC2_METADATA_DISABLED`` so that botocore never waits on a
  cloud metadata service.

The server is one per test process (moto keeps its buckets in process-wide state), on a
free port of 127.0.0.1, started on first use and stopped when the process exits.

**Why moto, and why one request at a time.** moto implements S3's conditional writes
(``PutObject`` with ``If-None-Match: *`` answers 412 with ``Condition: If-None-Match``
when the key exists, which s3fs turns into ``FileExistsError``), is pure Python (pip, no
binary or container to fetch) and is maintained against botocore's service models.
Its threaded server is not a faithful S3 under concurrency, though: its If-None-Match
check and the write after it are two steps, and with racing requests two creates of one
key both succeeded (6 keys of 100 with 8 racers each, ``sys.setswitchinterval(1e-6)``),
where AWS documents the conditional write as atomic. The WSGI application is therefore
wrapped in a lock: requests are served one at a time, which is the atomicity S3
guarantees (and what the protocol under test relies on), not a weaker one.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import socket
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional

import pytest

REGION = "us-east-1"


# How the server can be told to misbehave (LocalS3.misbehaving), as S3-compatible stores
# without conditional writes, or an endpoint in trouble, do:
IGNORE_CONDITIONS = "ignore_conditions"  # If-None-Match is dropped: a create overwrites (no conditional writes)
REJECT_CONDITIONS = "reject_conditions"  # a conditional PUT answers 501 NotImplemented
UNAVAILABLE = "unavailable"  # every request answers 503 SlowDown (an endpoint under trouble)
_ERRORS = {REJECT_CONDITIONS: ("501 Not Implemented", "NotImplemented", "conditional writes are not implemented"),
           UNAVAILABLE: ("503 Slow Down", "SlowDown", "please reduce your request rate")}


class _OneAtATime:
    """A WSGI application that serves one request at a time (see the module docstring),
    remembers the last requests (method, path, If-None-Match) and can misbehave."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests: deque[tuple[str, str, Optional[str]]] = deque(maxlen=10_000)
        self.misbehaviour: Optional[str] = None

    def __call__(self, environ: dict, start_response: Callable[..., Any]) -> list[bytes]:
        with self.lock:
            condition = environ.get("HTTP_IF_NONE_MATCH")
            self.requests.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), condition))
            how = self.misbehaviour
            if how == IGNORE_CONDITIONS:
                environ.pop("HTTP_IF_NONE_MATCH", None)
            elif how == UNAVAILABLE or (how == REJECT_CONDITIONS and condition is not None):
                status, code, message = _ERRORS[how]
                start_response(status, [("Content-Type", "application/xml")])
                return [f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()]
            # the whole body inside the lock: a streamed response is the request's work too
            return list(self.app(environ, start_response))


class _Server:
    """moto's S3 on 127.0.0.1:<free port>, in a daemon thread."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        self.app = app = _OneAtATime(DomainDispatcherApplication(create_backend_app))
        self.httpd = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="local-s3", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


_SERVER: Optional[_Server] = None
_START = threading.Lock()


def server() -> _Server:
    """The test process's local S3 server (started on first use)."""
    global _SERVER
    with _START:
        if _SERVER is None:
            _SERVER = _Server()
        return _SERVER


def environment(endpoint: str) -> dict[str, str]:
    """The variables a user of an S3-compatible store sets (see docs/decoupled.md)."""
    return {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}


@dataclass
class LocalS3:
    """One test's bucket on the local server."""

    endpoint: str
    bucket: str

    def url(self, prefix: str = "run") -> str:
        """``s3://<bucket>/<prefix>``: a store URL for ``diloco.decoupled.store_url``."""
        return f"s3://{self.bucket}/{prefix}"

    def filesystem(self) -> Any:
        """The s3fs filesystem of this endpoint (the one dipaco's store gets: fsspec caches it)."""
        import s3fs

        return s3fs.S3FileSystem()

    def requests(self, method: Optional[str] = None) -> list[tuple[str, str, Optional[str]]]:
        """The requests the server received for this bucket so far: (method, path, If-None-Match)."""
        mine = f"/{self.bucket}"
        return [r for r in list(server().app.requests)
                if (r[1] == mine or r[1].startswith(mine + "/")) and method in (None, r[0])]

    @contextlib.contextmanager
    def misbehaving(self, how: str) -> Iterator[None]:
        """The server misbehaves ``how`` (IGNORE_CONDITIONS, REJECT_CONDITIONS, UNAVAILABLE)
        for every bucket until the block ends."""
        app = server().app
        assert how in (IGNORE_CONDITIONS, *_ERRORS), how
        app.misbehaviour = how
        try:
            yield
        finally:
            app.misbehaviour = None


def _forget_cached_filesystems() -> None:
    # fsspec caches filesystems by constructor arguments, not by environment: one made
    # before the endpoint variables were set would keep talking to AWS
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterable[LocalS3]:
    """A fresh bucket on the local S3 server, with the environment that reaches it."""
    srv = server()
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment(srv.endpoint).items():
        monkeypatch.setenv(name, value)
    _forget_cached_filesystems()
    local = LocalS3(srv.endpoint, f"t-{uuid.uuid4().hex[:20]}")
    local.filesystem().mkdir(local.bucket)
    yield local
    srv.app.misbehaviour = None
    _forget_cached_filesystems()  # the next test may have another environment


def free_port() -> int:
    """A TCP port nobody listens on now (for an endpoint that refuses connections)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["IGNORE_CONDITIONS", "REJECT_CONDITIONS", "UNAVAILABLE", "LocalS3", "environment", "free_port", "s3",
           "server"]
