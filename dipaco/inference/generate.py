"""Routed generation: one path decodes at a time, re-routed every W tokens if asked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from dipaco.inference.sampling import check_sampling, sample_token
from dipaco.runtime.device import model_device
from modules import PathModel



class PathSource(Protocol):
    """What generation asks of a path loader (:class:`dipaco.inference.run.PathLoader`)."""

    def get(self, path_id: int) -> PathModel: ...


class RoutedModel(Protocol):
    """What generation asks of a trained run (:class:`dipaco.inference.run.InferenceRun`,
    which imports this module: generation names the interface, not the class)."""

    tokenizer: Any
    router: Any

    def route(self, token_ids: Sequence[int]) -> int: ...

    def loader(self, cache_size: int = 1) -> PathSource: ...


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """The result of :func:`generate_routed`.

    Attributes:
        prompt: prompt token ids.
        tokens: generated token ids (eos included when generation stopped on it).
        window_paths: the path of each window of ``reroute_every`` tokens over
            ``prompt + tokens`` (``router.reroute_windows``'s rule); without re-routing, ``[path]``.
        switches: ``(sequence position, path)`` each time generation started using a path.
        stopped_at_eos: generation ended on the eos token.
        finish_reason: ``"eos"``, ``"length"`` or ``"cancelled"`` (set by the engine and here).
    """

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    window_paths: list[int] = field(default_factory=list)
    switches: list[tuple[int, int]] = field(default_factory=list)
    stopped_at_eos: bool = False
    finish_reason: Optional[str] = None

    @property
    def sequence(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt + self.tokens


class _PathDecoder:
    """Next-token logits of one path over a growing sequence, with or without KV cache."""

    def __init__(self, model: PathModel, use_kv_cache: bool) -> None:
        self.model = model
        self.max_len = model.cfg.max_seq_len
        self.cache = model.new_kv_cache(1, self.max_len) if use_kv_cache else None
        self.start = 0  # sequence position of the cache's first token
        self.device = model_device(model)

    @torch.no_grad()
    def next_logits(self, seq: list[int]) -> torch.Tensor:
        """Logits ``[V]`` for the token after ``seq`` (seeing its last ``max_seq_len`` tokens)."""
        if self.cache is None:
            window = seq[-self.max_len:]
            return self.model(self._ids(window))[0, -1].float().cpu()
        new = seq[self.start + self.cache.length:]
        if self.cache.length + len(new) > self.max_len or not new:
            # The window slid (rotary positions shift) or nothing is new: re-encode it.
            self.cache.reset()
            self.start = max(0, len(seq) - self.max_len)
            new = seq[self.start:]
        return self.model(self._ids(new), self.cache)[0, -1].float().cpu()

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """``[1, n]`` token ids on the model's device (logits come back to the CPU sampler)."""
        return torch.tensor([ids], dtype=torch.long, device=self.device)


def generate_routed(
    run: RoutedModel,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: int = 0,
    reroute_every: Optional[int] = None,
    use_kv_cache: bool = True,
    stop_at_eos: bool = True,
    loader: Optional[PathSource] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> Generation:
    """Continue ``prompt_ids`` with the path its prefix routes to (re-routing every W tokens).

    Args:
        temperature: 0 is greedy; otherwise softmax sampling at this temperature.
        top_k: sample among the ``top_k`` likeliest tokens only.
        top_p: then among the smallest set of likeliest tokens whose probability reaches it.
        seed: seeds the sampler (a private generator; the global RNG is untouched).
        reroute_every: W; ``None`` routes once by the prompt.
        use_kv_cache: ``False`` re-runs the whole context each step (slow; same tokens).
        stop_at_eos: stop after generating the eos token.
        loader: a ``PathLoader`` to use (default: a fresh one, one path in memory).
        on_token: called with each generated token id as soon as it is chosen.
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    if reroute_every is not None and reroute_every < 1:
        raise ValueError(f"reroute_every must be >= 1 token, got {reroute_every}")
    loader = loader or run.loader()
    generator = torch.Generator().manual_seed(int(seed))
    eos = run.tokenizer.eos_id
    out = Generation(prompt=prompt)
    seq = list(prompt)
    window_path: dict[int, int] = {}

    def path_at(pos: int) -> int:
        """Path generating sequence position ``pos`` (reroute_windows's rule)."""
        j = 0 if reroute_every is None else pos // reroute_every
        if j not in window_path:
            if reroute_every is None:
                window_path[j] = run.route(prompt)
            else:
                ctx = run.router.window_context(seq, j, reroute_every)
                window_path[j] = int(run.router.route_contexts([ctx])[0])
        return window_path[j]

    decoder: Optional[_PathDecoder] = None
    for _ in range(max_new_tokens):
        p = path_at(len(seq))
        if decoder is None or decoder.model.path_id != p:
            decoder = None  # release the old path's cache before loading the new path
            decoder = _PathDecoder(loader.get(p), use_kv_cache)
            out.switches.append((len(seq), p))
        tok = int(sample_token(decoder.next_logits(seq), temperature, top_k, top_p, generator))
        seq.append(tok)
        out.tokens.append(tok)
        if on_token is not None:
            on_token(tok)
        if stop_at_eos and tok == eos:
            out.stopped_at_eos = True
            break
    out.finish_reason = "eos" if out.stopped_at_eos else "length"
    if reroute_every is None:
        out.window_paths = [path_at(0)]
    else:
        # Windows that hold only prompt tokens were never needed for generating; fill them
        # (and a window the last token opened) in by the same rule, for the record, in one
        # router call (a call costs far more than a context in it).
        n_windows = -(-len(seq) // reroute_every)
        missing = [j for j in range(n_windows) if j not in window_path]
        if missing:
            ctxs = [run.router.window_context(seq, j, reroute_every) for j in missing]
            window_path.update(zip(missing, map(int, run.router.route_contexts(ctxs))))
        out.window_paths = [window_path[j] for j in range(n_windows)]
    return out
