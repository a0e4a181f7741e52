"""One choice of a completion: its engine row, its text (:class:`~dipaco.serve.text.TextAssembler`),
the paths that made it, and its ``logprobs`` object as OpenAI's completions API (and vLLM)
shape it (:class:`LogprobLog`).

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [...], "text_offset": [...]}

One entry per token: the token as text (decoded alone), its log-probability under the
path that made it (natural log, the model's own distribution: fp32 log-softmax of the
logits, before temperature, penalties or any other sampling rule, as vLLM reports it by
default), the ``logprobs`` likeliest tokens with theirs (and the token itself when it is
not among them, as vLLM does), and where the token's text begins: the running sum of the
tokens' text lengths, from the start of the choice's ``text``. With ``echo`` the prompt's
tokens come first, and the first of them has ``null`` for both (nothing precedes it).
Token texts are the keys of ``top_logprobs``: two tokens that decode alike (the halves of
one character split over tokens) share a key, the likelier one kept.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dipaco.serve.model import ServedModel
from dipaco.serve.text import TextAssembler

# (log-probability, [(token id, log-probability), ...] likeliest first), as the engine reports it
TokenLogprob = tuple[float, Sequence[tuple[int, float]]]


class LogprobLog:
    """The ``logprobs`` object of one choice, built as its tokens arrive."""

    def __init__(self, model: ServedModel, top: int) -> None:
        self.model = model
        self.top = int(top)
        self.tokens: list[str] = []
        self.token_logprobs: list[Optional[float]] = []
        self.top_logprobs: list[Optional[dict[str, float]]] = []
        self.text_offset: list[int] = []
        self._offset = 0
        self._sent = 0  # entries already streamed

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def cumulative(self) -> float:
        """Sum of the log-probabilities recorded (``best_of`` ranks choices by it)."""
        return sum(x for x in self.token_logprobs if x is not None)

    def add(self, token: int, scored: Optional[TokenLogprob]) -> None:
        """One token and its log-probabilities (``None``: it has none, as a prompt's first)."""
        text = self.model.token_text(token)
        self.tokens.append(text)
        self.text_offset.append(self._offset)
        self._offset += len(text)
        if scored is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        logprob, likeliest = scored
        self.token_logprobs.append(float(logprob))
        top: dict[str, float] = {}
        for tid, lp in list(likeliest)[:self.top]:
            top.setdefault(self.model.token_text(tid), float(lp))
        top.setdefault(text, float(logprob))
        self.top_logprobs.append(top)

    def add_prompt(self, ids: Sequence[int], scored: Optional[Sequence[Optional[TokenLogprob]]]) -> None:
        """The prompt's tokens (``echo``), each with what the engine scored for it."""
        scored = list(scored) if scored is not None else [None] * len(ids)
        for token, s in zip(ids, scored):
            self.add(token, s)

    def whole(self) -> dict[str, Any]:
        """Every entry so far."""
        return self._slice(0)

    def part(self) -> dict[str, Any]:
        """The entries since the last :meth:`part` (a streamed chunk's)."""
        out = self._slice(self._sent)
        self._sent = len(self.tokens)
        return out

    def _slice(self, start: int) -> dict[str, Any]:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top_logprobs[start:], "text_offset": self.text_offset[start:]}


@dataclass
class Choice:
    """One row: its engine request, text so far, paths used, finish reason."""

    index: int
    prompt: int                       # which prompt of the request
    prompt_ids: list[int]
    text: TextAssembler
    echo: Optional[str] = None        # the prompt's text (echo), sent before the completion's
    logprobs: Optional[LogprobLog] = None
    request_id: int = -1
    tokens: int = 0
    started: bool = False
    cumulative: float = 0.0           # sum of its tokens' log-probabilities (best_of ranks by it)
    switches: list[dict[str, int]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None           # the stop string or stop token id that ended it (vLLM's field)

    def record_path(self, path: int) -> None:
        """Note the path that generated the latest token (a switch when it changed)."""
        if not self.switches or self.switches[-1]["path"] != path:
            self.switches.append({"position": len(self.prompt_ids) + self.tokens - 1, "path": int(path)})

    def dipaco(self) -> dict[str, Any]:
        """This server's extension of a choice: the paths it used, in order, and where each began."""
        return {"paths": [s["path"] for s in self.switches], "switches": list(self.switches)}
