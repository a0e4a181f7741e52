"""What the server knows of the run it serves, and the limits it enforces.

The HTTP layer needs a run's tokenizer, context length and name only; keeping them in
:class:`ServedModel` (built from an :class:`~dipaco.inference.InferenceRun` by
:meth:`ServedModel.from_run`) lets the server be tested with a stand-in engine and tokenizer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from dipaco.inference.run import InferenceRun


class TextTokenizer(Protocol):
    """The part of :class:`dipaco.data.Tokenizer` the server uses."""

    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class ServedModel:
    """The one model a server offers.

    Attributes:
        name: the model id clients send (``model``) and answers carry; the run directory's
            name unless ``--served-model-name`` says otherwise.
        tokenizer: encodes prompts, decodes generated tokens.
        max_seq_len: the model's context (every path has the same): a prompt and its
            ``max_tokens`` must fit in it (OpenAI's rule) unless the server slides past it.
        num_paths: paths of the grid (reported by ``/v1/models``).
        created: Unix time the model was made (the run directory's modification time).
        info: extra facts ``/v1/models`` shows under ``dipaco``.
        vocab_size: token ids a prompt given as ids may hold (``None``: not checked here).
        aliases: further names a request may use for it (``--served-model-name A B``: B).
    """

    name: str
    tokenizer: TextTokenizer
    max_seq_len: int
    num_paths: int
    created: int = field(default_factory=lambda: int(time.time()))
    info: dict[str, Any] = field(default_factory=dict)
    vocab_size: Optional[int] = None
    aliases: tuple[str, ...] = ()
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    @classmethod
    def from_run(cls, run: "InferenceRun", name: Optional[str] = None,
                 checkpoint: Optional[str] = None, aliases: Sequence[str] = ()) -> "ServedModel":
        """The model of an opened run; ``name`` defaults to the run directory's name,
        ``checkpoint`` to the run's (give it when another process opened the weights)."""
        root = Path(run.run.root)
        return cls(name=name or root.resolve().name, tokenizer=run.tokenizer,
                   max_seq_len=int(run.cfg.model.max_seq_len), num_paths=run.num_paths,
                   created=int(root.stat().st_mtime),
                   info={"grid": list(run.cfg.grid.levels), "prefix_tokens": run.prefix_tokens,
                         "max_seq_len": int(run.cfg.model.max_seq_len), "checkpoint": Path(checkpoint or run.checkpoint).name},
                   vocab_size=min(int(run.cfg.model.vocab_size), int(run.tokenizer.vocab_size)), aliases=tuple(aliases))

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a request may give in ``model``: :attr:`name` first."""
        return (self.name, *self.aliases)

    @property
    def eos_text(self) -> str:
        """The end-of-text token as text (``<|endoftext|>``)."""
        return self.token_text(self.tokenizer.eos_id)

    def token_text(self, token: int) -> str:
        """One token decoded alone, as the ``logprobs`` object shows it (cached: the
        vocabulary is small and the same tokens recur)."""
        text = self._token_texts.get(token)
        if text is None:
            text = self._token_texts[token] = self.tokenizer.decode([int(token)])
        return text


@dataclass
class ServeLimits:
    """What one request may ask for (the CLI's flags).

    Attributes:
        max_tokens_cap: the largest ``max_tokens`` accepted (a larger one is refused, not
            cut); ``None``: only the length rule bounds it.
        max_body_bytes: request bodies above this are refused with 413 before parsing.
        max_choices: choices one request may ask for: its prompts times ``best_of`` (or ``n``).
        max_stop_strings: stop strings one request may give.
        reroute_every: re-route every W tokens (``None``: route once by the prompt).
        default_max_tokens: ``max_tokens`` when a request does not say (OpenAI's default, 16),
            lowered to what fits in the context after the prompt.
        slide_past_context: accept a prompt + ``max_tokens`` longer than the context (the
            model then reads the last ``max_seq_len`` tokens); otherwise that is a 400.
    """

    max_tokens_cap: Optional[int] = None
    max_body_bytes: int = 1 << 20
    max_choices: int = 64
    max_stop_strings: int = 32
    reroute_every: Optional[int] = None
    default_max_tokens: int = 16
    slide_past_context: bool = False
