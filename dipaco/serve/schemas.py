"""The request schemas of the server's endpoints and the domain of every number they hold.

The one module that uses pydantic. Every field a client can send is declared here, once:
:data:`REQUEST_SCHEMAS` maps each endpoint to its schema, and each number's domain is a
:class:`Domain` in its field's ``Annotated`` metadata (:func:`field_domains` lists them),
checked by :func:`check_domains`; what depends on the model or the server's settings (the
length rule, the vocabulary, the number of stop strings) is checked where those are known
(:meth:`dipaco.serve.completions.CompletionService.check`) and named in the domain's
``note``. Types are strict (``"5"`` is not a number, ``true`` not an integer) and unknown
fields are refused, so a typo is never silently ignored; every refusal is one line naming
the field (:func:`validation_error`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Optional, Sequence, Type, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from dipaco.serve.errors import APIError, bad_request

MAX_SEED = 2**63 - 1
MAX_REROUTE = 2**20
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (OpenAI's legacy completions allowed 5)
MAX_N = 128        # OpenAI's bound on n; a request's choices are bounded by --max-choices too
_BOM = b"\xef\xbb\xbf"

Number = Union[StrictFloat, StrictInt]


@dataclass(frozen=True)
class Domain:
    """The values a numeric field accepts: a finite number in ``[low, high]`` (either end
    open, or absent), or one of ``also`` (values outside the range with a meaning, said in
    ``note``). NaN and ±inf are outside every domain. ``note`` also names the rest of the
    rule where it depends on the model or the server's settings."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    also: tuple = ()
    note: str = ""

    def contains(self, value: Any) -> bool:
        """Whether ``value`` (an int or a float) lies in the domain."""
        if value in self.also:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """The rule in words, as a refusal says it (``lie in [0, 2]``, ``be >= 1 or -1 (off)``)."""
        if self.low is not None and self.high is not None:
            text = (f"lie in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"be {'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            text = f"be {'<' if self.high_open else '<='} {_num(self.high)}"
        if self.also:
            text += " or " + " or ".join(str(a) for a in self.also)
        return text + (f" ({self.note})" if self.note and self.also else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**64 else str(x)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage counts."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``: OpenAI's fields, vLLM's sampling extras
    (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``, ``ignore_eos``,
    ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``) and this
    server's ``reroute_every``. ``suffix`` is accepted only empty (refused otherwise, not
    ignored). docs/serving.md says what each does.
    """

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    prompt: Any  # str | list[str] | list[int] | list[list[int]]; checked by prompts_of (clear message)
    max_tokens: Annotated[Optional[StrictInt], Domain(0, note="prompt + max_tokens <= the model's context, "
                                                        "unless the server slides past it; 0 only with echo")] = None
    temperature: Annotated[Optional[Number], Domain(0, 2, note="below 1e-5: greedy")] = None
    top_p: Annotated[Optional[Number], Domain(0, 1, low_open=True)] = None
    top_k: Annotated[Optional[StrictInt], Domain(1, also=(-1,), note="-1: off")] = None
    min_p: Annotated[Optional[Number], Domain(0, 1)] = None
    seed: Annotated[Optional[StrictInt], Domain(0, MAX_SEED)] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None  # at most --max-stop-strings, none empty
    stop_token_ids: Optional[list[StrictInt]] = None  # token ids of the vocabulary
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: Annotated[StrictInt, Domain(1, MAX_N, note="prompts x best_of <= --max-choices")] = 1
    best_of: Annotated[Optional[StrictInt], Domain(1, MAX_N, note=">= n")] = None
    logprobs: Annotated[Optional[StrictInt], Domain(0, MAX_LOGPROBS)] = None
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    presence_penalty: Annotated[Optional[Number], Domain(-2, 2)] = None
    frequency_penalty: Annotated[Optional[Number], Domain(-2, 2)] = None
    repetition_penalty: Annotated[Optional[Number], Domain(0.01, 100)] = None
    logit_bias: Optional[dict[str, Annotated[Number, Domain(-100, 100)]]] = None  # token id (as text) -> bias
    min_tokens: Annotated[Optional[StrictInt], Domain(0, note="<= max_tokens")] = None
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    user: Optional[StrictStr] = None
    reroute_every: Annotated[Optional[StrictInt], Domain(1, MAX_REROUTE)] = None


class TokenizeRequest(BaseModel):
    """The body of ``POST /tokenize`` (vLLM's shape). No special token is ever added (the
    model was trained without), so ``add_special_tokens`` changes nothing."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    """The body of ``POST /detokenize`` (vLLM's shape): token ids of the vocabulary."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    tokens: list[StrictInt]


# every endpoint that reads a body, and its schema: what a client can send, in one place
REQUEST_SCHEMAS: dict[str, Type[BaseModel]] = {"/v1/completions": CompletionRequest, "/tokenize": TokenizeRequest,
                                               "/detokenize": DetokenizeRequest}


def field_domains(schema: Type[BaseModel]) -> dict[str, Domain]:
    """The :class:`Domain` of each numeric field of ``schema`` that declares one (for
    ``logit_bias``, the domain of its values)."""
    out: dict[str, Domain] = {}
    for name, info in schema.model_fields.items():
        found = [m for m in info.metadata if isinstance(m, Domain)] or _inner_domains(info.annotation)
        if found:
            out[name] = found[0]
    return out


def _inner_domains(annotation: Any) -> list[Domain]:
    """Domains nested in a container's annotation (``dict[str, Annotated[float, Domain]]``)."""
    found: list[Domain] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        found += [m for m in getattr(arg, "__metadata__", ()) if isinstance(m, Domain)] + _inner_domains(arg)
    return found


def check_domains(req: BaseModel) -> None:
    """Refuse (400, one line naming the field) a number outside its field's domain."""
    for name, domain in field_domains(type(req)).items():
        value = getattr(req, name)
        values = value.items() if isinstance(value, dict) else [(None, value)]
        for key, v in values:
            if v is not None and not domain.contains(v):
                where = name if key is None else f"{name}[{key!r}]"
                raise bad_request(f"{where} must {domain.describe()}, got {v}", name)


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
    """Refuse numbers outside their domains and combinations this server cannot honour."""
    check_domains(req)
    if req.stream_options is not None and not req.stream:  # as OpenAI: it would be ignored
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if req.best_of is not None and req.best_of < req.n:
        raise bad_request(f"best_of ({req.best_of}) must be >= n ({req.n})", "best_of")
    if req.stream and (req.best_of or req.n) > req.n:  # as OpenAI: the best are known at the end only
        raise bad_request("best_of > n cannot be streamed (the best choices are known only at the end)", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported by this server (a completion continues the prompt only)",
                          "suffix")
    for key in req.logit_bias or {}:
        if not key.isdigit():
            raise bad_request(f"logit_bias keys are token ids, got {key!r}", "logit_bias")


def stops_of(stop: Union[None, str, Sequence[str]], limit: int) -> list[str]:
    """Stop strings (at most ``limit``: the server's --max-stop-strings; none empty)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limit:
        raise bad_request(f"stop holds {len(stops)} strings; at most {limit} (the server's --max-stop-strings)",
                          "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop holds an empty string; every stop string needs a character", "stop")
    return stops


def validation_error(errors: Sequence[dict[str, Any]], schema: Type[BaseModel] = CompletionRequest) -> APIError:
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
        known = ", ".join(schema.model_fields)
        return bad_request(f"unknown field {where!r} (this endpoint reads: {known})", field)
    return bad_request(f"{where}: {err.get('msg', 'invalid value')}", field)


def parse_body(schema: Type[BaseModel], body: Union[bytes, str], content_type: Optional[str] = None) -> Any:
    """The ``schema`` request of a body: the one parser every body goes through.

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
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e.errors(), schema) from None


def parse_completion(body: Union[bytes, str], content_type: Optional[str] = None) -> CompletionRequest:
    """:func:`parse_body` of a ``POST /v1/completions`` body."""
    return parse_body(CompletionRequest, body, content_type)
