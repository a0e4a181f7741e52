"""Generated tokens to text as they arrive: stop strings cut it, split characters wait.

A byte-level tokenizer can split one UTF-8 character over two tokens; the decoded text then
ends in U+FFFD until the rest arrives, so that tail is held back. A stop string can also
arrive over several tokens, so a tail that could still become one is held back too: text
sent to a streaming client is never taken back.
"""
from __future__ import annotations

from typing import Optional, Sequence

from dipaco.serve.model import TextTokenizer

_REPLACEMENT = "\ufffd"


class TextAssembler:
    """The text of one choice, token by token.

    :meth:`add` returns the text that became final with that token; :attr:`stopped` turns
    true when a stop string appeared (the text ends just before it, the stop itself is not
    returned, as OpenAI does; with ``include_stop`` it ends just after it) and
    :attr:`stop_reason` is that string. Tokens in ``skip`` (the special tokens, by
    default the end-of-text token) are never part of the text. Stop strings are looked for
    once ``min_tokens`` tokens have come (vLLM's rule for its ``min_tokens``).
    """

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str] = (), eos_id: Optional[int] = None, *,
                 skip: Optional[Sequence[int]] = None, include_stop: bool = False, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.skip = set(skip if skip is not None else ([] if eos_id is None else [eos_id]))
        self.include_stop = include_stop
        self.min_tokens = int(min_tokens)
        self.ids: list[int] = []
        self.count = 0  # tokens taken, skipped ones included
        self.text = ""  # what has been returned so far
        self.stopped = False
        self.stop_reason: Optional[str] = None

    def add(self, token: int) -> str:
        """Take one generated token; return the text it made final (maybe empty)."""
        if self.stopped:
            return ""
        self.count += 1
        if token in self.skip:
            return ""
        self.ids.append(int(token))
        full = self.tokenizer.decode(self.ids)
        cut = self._first_stop(full) if self.count >= self.min_tokens else None
        if cut is not None:
            self.stopped = True
            return self._emit(full, cut + (len(self.stop_reason or "") if self.include_stop else 0))
        safe = len(full.rstrip(_REPLACEMENT)) if full.endswith(_REPLACEMENT) else len(full)
        safe = min(safe, len(full) - self._stop_prefix_len(full))
        return self._emit(full, safe)

    def add_all(self, tokens: "Sequence[int]") -> str:
        """:meth:`add` of each token in turn; without stop strings, one decode for all of them."""
        if self.stops:
            return "".join(self.add(t) for t in tokens)
        if self.stopped:
            return ""
        self.count += len(tokens)
        self.ids.extend(int(t) for t in tokens if t not in self.skip)
        full = self.tokenizer.decode(self.ids)
        safe = len(full.rstrip(_REPLACEMENT)) if full.endswith(_REPLACEMENT) else len(full)
        return self._emit(full, safe)

    def finish(self) -> str:
        """The held-back rest, once no token will follow."""
        if self.stopped or not self.ids:
            return ""
        full = self.tokenizer.decode(self.ids)
        return self._emit(full, len(full))

    # ---------------------------------------------------------------- helpers

    def _emit(self, full: str, end: int) -> str:
        start = len(self.text)
        if end <= start:
            return ""
        new = full[start:end]
        self.text += new
        return new

    def _first_stop(self, full: str) -> Optional[int]:
        """Where the earliest stop string starts in ``full`` (None: none does).

        The text already returned holds no whole stop string, so a match can start at most
        ``len(stop) - 1`` characters before its end.
        """
        best = None
        for s in self.stops:
            i = full.find(s, max(0, len(self.text) - len(s) + 1))
            if i >= 0 and (best is None or i < best):
                best, self.stop_reason = i, s
        return best

    def _stop_prefix_len(self, full: str) -> int:
        """Length of the longest tail of ``full`` that begins some stop string."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:k]):
                    longest = k
                    break
        return longest
