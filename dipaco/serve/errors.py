"""The server's error: one line for the client, in OpenAI's error object.

Every refusal the server makes (a bad field, an unknown model, a body too large, the
engine down) is an :class:`APIError`; the app turns it into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status, never a traceback.
"""
from __future__ import annotations

from typing import Any, Optional

# OpenAI's error ``type`` values, by the HTTP status that carries them
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """A refused request: HTTP ``status``, a one-line ``message``, the offending ``param``."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        self.status = int(status)
        self.message = one_line(message)
        self.param = param
        self.code = code
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return error_body(self.status, self.message, param=self.param, code=self.code)


def one_line(message: str) -> str:
    """``message`` on one line (whitespace runs, newlines included, become one space)."""
    return " ".join(str(message).split())


def error_body(status: int, message: str, *, param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI's API returns it for ``status``."""
    kind = _TYPES.get(int(status), "invalid_request_error" if 400 <= int(status) < 500 else "server_error")
    return {"error": {"message": one_line(message), "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=param, code=code)
