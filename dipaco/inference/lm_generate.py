"""Continuations for lm-eval's ``generate_until`` requests: routed (or dense) generation,
the text cut at the first stop string.

Each context is routed on its own first ``prefix_tokens`` tokens (as ``dipaco-infer
generate`` routes a prompt); a context longer than the model's window is read through
its last ``max_seq_len`` tokens (the package's long-context rule). Generation stops at
end-of-text or after ``max_gen_toks`` tokens; the decoded text is then cut before the
first ``until`` string, as lm-eval's models do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dipaco.config.domains import Domain, problem
from dipaco.inference.engine import Request, RoutedEngine
from dipaco.inference.generate import generate_routed
from dipaco.inference.sampling import check_sampling

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for its own models
_KNOWN = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed"}
# The domain of each number a task's generation_kwargs may give (dipaco-infer generate's
# flags' ranges): a value outside it, of another type (a string, a bool, 3.5 tokens), NaN
# or infinite is refused naming the setting, never truncated or cast.
GEN_DOMAINS: dict[str, Domain] = {
    "max_gen_toks": Domain("int", 0, 2**20), "temperature": Domain("real", 0, 100),
    "top_k": Domain("int", 1, 2**31 - 1, null=True), "top_p": Domain("real", 0, 1, lo_open=True, null=True),
    "seed": Domain("int", 0, 2**63 - 1), "do_sample": Domain("flag"),
}


@dataclass
class GenSettings:
    """One request's generation settings, from lm-eval's ``gen_kwargs``."""

    until: list[str]
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0


def gen_settings(kwargs: dict, eot_text: str) -> GenSettings:
    """``gen_kwargs`` → :class:`GenSettings`; ``ValueError`` names a setting this model cannot honour.

    Greedy unless ``do_sample`` is true (then ``temperature``, default 1.0), as lm-eval's
    Hugging Face model reads them; the end-of-text text is always a stop string.
    """
    unknown = sorted(set(kwargs) - _KNOWN)
    if unknown:
        raise ValueError(f"generation setting(s) {unknown} are not supported by the dipaco model "
                         f"(supported: {sorted(_KNOWN)})")
    for key, dom in GEN_DOMAINS.items():
        bad = problem(dom, kwargs[key], None) if key in kwargs else None
        if bad:
            raise ValueError(f"generation setting {key}: {bad}")
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else [str(u) for u in until]
    if eot_text and eot_text not in until:
        until.append(eot_text)
    sample = kwargs.get("do_sample", False)
    temperature = kwargs.get("temperature", 1.0) if sample else 0.0
    top_k, top_p = kwargs.get("top_k"), kwargs.get("top_p")
    s = GenSettings(until=until, max_gen_toks=kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS),
                    temperature=float(temperature), top_k=top_k if sample else None,
                    top_p=None if top_p is None or not sample else float(top_p), seed=kwargs.get("seed", 0))
    check_sampling(s.temperature, s.top_k, s.top_p)
    return s


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest stop string in it."""
    cut = len(text)
    for stop in until:
        if stop:
            i = text.find(stop)
            if i != -1:
                cut = min(cut, i)
    return text[:cut]


class _DenseRun:
    """What :func:`generate_routed` reads of a run, answering every prompt with one model."""

    def __init__(self, run: Any, model: Any) -> None:
        self.tokenizer, self._model = run.tokenizer, model

    def route(self, prompt: Sequence[int]) -> int:
        return int(self._model.path_id)

    def get(self, path: int) -> Any:
        return self._model


def generate_texts(lm: Any, requests: Sequence[tuple[str, dict]]) -> list[str]:
    """The continuation of each ``(context, gen_kwargs)``, cut at its stop strings.

    ``lm`` is a :class:`~dipaco.inference.lm_eval_adapter.DipacoLM` (its run, its models,
    whether it is the dense baseline, its path counter). Routed requests go through one
    :class:`RoutedEngine` (batched by path, ``lm.batch_size`` rows a step, sharing the
    scorer's path loader so memory stays ``max_loaded_paths`` paths); the dense baseline
    decodes one request at a time (the engine routes, and the baseline has no router).
    """
    eot = lm.eot_token_id
    eot_text = lm.run.tokenizer.decode([eot])
    settings = [gen_settings(dict(kwargs or {}), eot_text) for _, kwargs in requests]
    prompts = [lm.run.encode(context) or [eot] for context, _ in requests]  # an empty context: after end-of-text
    if lm.dense:
        shim = _DenseRun(lm.run, lm.models.model)
        gens = [generate_routed(shim, p, max_new_tokens=s.max_gen_toks, temperature=s.temperature,  # type: ignore[arg-type]
                                top_k=s.top_k, top_p=s.top_p, seed=s.seed, loader=shim)  # type: ignore[arg-type]
                for p, s in zip(prompts, settings)]
    else:
        engine = RoutedEngine(lm.run, max_batch_size=lm.batch_size, max_loaded_paths=lm.max_loaded_paths)
        engine.loader = lm.models.loader  # one LRU of paths for scoring and generation
        gens = engine.generate([Request(p, max_new_tokens=s.max_gen_toks, temperature=s.temperature, top_k=s.top_k,
                                        top_p=s.top_p, seed=s.seed) for p, s in zip(prompts, settings)])
    out = []
    for gen, s in zip(gens, settings):
        lm.requests_per_path.update(gen.window_paths[:1])
        out.append(cut_at_stop(lm.run.tokenizer.decode(gen.tokens), s.until))
    return out
