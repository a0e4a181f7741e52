"""The request schema of ``POST /v1/completions`` (OpenAI's completions API) and its checks.

The one module that uses pydantic. Types are strict (``"5"`` is not a number, ``true`` not
an integer) and unknown fields are refused, so a typo is never silently ignored; every
refusal is one line naming the field (:func:`validation_error`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from dipaco.serve.errors import APIError, bad_request

# OpenAI's limits, kept so a request valid here is valid there too
MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 1
MAX_REROUTE = 2**20
_BOM = b"\xef\xbb\xbf"


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``.

    ``top_k`` and ``reroute_every`` are this server's extensions; ``n``, ``best_of``,
    ``logprobs``, ``echo``, ``suffix``, penalties and ``logit_bias`` are accepted only at
    their neutral values (anything else is refused in one line, not ignored).
    """

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: Any  # str | list[str] | list[int] | list[list[int]]; checked by prompts_of (clear message)
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Union[StrictFloat, StrictInt]] = None
    top_p: Optional[Union[StrictFloat, StrictInt]] = None
    top_k: Optional[StrictInt] = None
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    best_of: Optional[StrictInt] = None
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    presence_penalty: Optional[Union[StrictFloat, StrictInt]] = None
    frequency_penalty: Optional[Union[StrictFloat, StrictInt]] = None
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None
    reroute_every: Optional[StrictInt] = None


def prompts_of(prompt: Any) -> list[Union[str, list[int]]]:
    """The prompts of a request: texts and/or token-id lists, one per choice."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(type(t) is int for t in prompt):
            return [list(prompt)]
        if all(ids(p) for p in prompt):
            return [list(p) for p in prompt]
    if prompt == []:
        raise bad_request("prompt is an empty list: give at least one prompt", "prompt")
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      f"non-empty lists of token ids (got {type(prompt).__name__})", "prompt")


def check_sampling(req: CompletionRequest) -> None:
    """Refuse values outside OpenAI's ranges and options this server does not implement."""
    t = req.temperature
    if t is not None and not 0 <= t <= 2:  # nan fails too
        raise bad_request(f"temperature must lie in [0, 2], got {t}", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad_request(f"top_p must lie in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < 1:
        raise bad_request(f"top_k must be >= 1, got {req.top_k}", "top_k")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise bad_request(f"seed must lie in [0, 2**63 - 1], got {req.seed}", "seed")
    if req.reroute_every is not None and not 1 <= req.reroute_every <= MAX_REROUTE:
        raise bad_request(f"reroute_every must lie in [1, {MAX_REROUTE}] tokens, got {req.reroute_every}",
                          "reroute_every")
    if req.stream_options is not None and not req.stream:  # as OpenAI: it would be ignored
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.n != 1:
        raise bad_request(f"n={req.n} is not supported: this server returns one choice per prompt (n=1); "
                          "send the request again for another sample", "n")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of={req.best_of} is not supported (only 1)", "best_of")
    if req.logprobs is not None:
        raise bad_request("logprobs is not supported by this server", "logprobs")
    if req.echo:
        raise bad_request("echo is not supported by this server", "echo")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise bad_request(f"{name} is not supported by this server (only 0)", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")


def stops_of(stop: Union[None, str, Sequence[str]]) -> list[str]:
    """Stop strings (at most four, none empty)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop holds an empty string; every stop string needs a character", "stop")
    return stops


def validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """One line for pydantic's / FastAPI's validation errors (the first one says enough)."""
    if not errors:
        return bad_request("the request body is not valid")
    err = errors[0]
    kind = str(err.get("type", ""))
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if kind == "json_invalid":
        why = (err.get("ctx") or {}).get("error") or err.get("msg", "")
        return bad_request(f"the request body is not valid JSON ({why})", code="invalid_json")
    if not loc or kind == "model_attributes_type":  # the body itself is not an object
        return bad_request("the request body must be a JSON object", code="invalid_json")
    field = loc[0]
    where = ".".join(loc)
    if kind == "missing":
        return bad_request(f"{where} is required", field)
    if kind == "extra_forbidden":
        known = ", ".join(CompletionRequest.model_fields)
        return bad_request(f"unknown field {where!r} (this server reads: {known})", field)
    return bad_request(f"{where}: {err.get('msg', 'invalid value')}", field)


def parse_completion(body: Union[bytes, str], content_type: Optional[str] = None) -> CompletionRequest:
    """The request of a ``POST /v1/completions`` body: the one parser every body goes through.

    pydantic's own JSON parser reads it, so text that is not UTF-8, a ``\\ud800`` escape
    without its pair and nesting past its depth limit are ``invalid_json`` 400s like any
    malformed JSON (Python's ``json`` module accepts lone surrogates, which then broke the
    tokenizer). A leading UTF-8 byte order mark is skipped. ``content_type``: the request's
    header; absent or JSON is read, anything else is a 415 naming the header.
    """
    media = (content_type or "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Content-Type is {media!r}; this server reads JSON bodies: send "
                       "Content-Type: application/json (curl: -H 'Content-Type: application/json')",
                       code="unsupported_media_type")
    if isinstance(body, bytes) and body.startswith(_BOM):
        body = body[len(_BOM):]
    if not body.strip():  # pydantic would say "EOF while parsing a value"
        raise bad_request("the request body is empty: send a JSON object", code="invalid_json")
    try:
        return CompletionRequest.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
