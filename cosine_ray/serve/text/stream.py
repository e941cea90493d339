"""Token ids → text, as they stream: incremental detokenization and a linear stop-string scan.

``Detokenizer`` is vLLM's incremental detokenizer: it decodes only a window of the last tokens
(``prefix_offset`` .. the end), and emits the part of that window's text past what the window's
first half decoded to, once it does not end in U+FFFD (an incomplete UTF-8 sequence: a byte-level
token may hold part of a character). A window that starts inside a character decodes to the same
leading U+FFFD in both halves, so the difference is exact, and a decoder that drops a leading
space (SentencePiece's ``▁``) sees the same context in both. Each token costs a decode of a few
tokens, so a response costs time linear in its length, where decoding the whole output at every
step cost time quadratic in it. At the end the text equals ``tokenizer.decode`` of all the ids
(tests/serve/test_text_stream.py checks it on random token sequences of the real tokenizer).

``TextStream`` runs the stop strings over that text: each new piece is searched together with the
at most ``max(len(stop)) - 1`` characters held back before it (a possible beginning of a stop
string), never the whole text again.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
MAX_WINDOW_TOKENS = 32
"""Tokens a decode window may hold unemitted: past them the text is emitted even though it ends
in U+FFFD. A real character takes at most 4 bytes, so only a run of this many tokens each
ending in invalid UTF-8 gets there; the bound keeps such output linear too."""


class Detokenizer:
    """One output's incremental decode (``skip_special_tokens``, as the whole-text decode)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        """Where the decode window begins: the tokens before it have been emitted."""
        self.read_offset = 0
        """Tokens whose text has been emitted (the window's first half ends here)."""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """The text that ``token_id`` makes certain (may be empty while a character is incomplete)."""
        self.token_ids.append(token_id)
        return self._emit(is_final=False)

    def flush(self) -> str:
        """The rest, at the end of the output: an incomplete last character becomes U+FFFD."""
        return self._emit(is_final=True)

    def _emit(self, is_final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        is_held = len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT)
        if is_held and not is_final and len(self.token_ids) - self.read_offset < MAX_WINDOW_TOKENS:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]


class TextStream:
    """Token ids → text deltas, ending before the first stop string.

    ``text`` is the output's text so far (before the stop string once stopped); ``token_ids``
    its tokens, cut after the one that completed a stop string: the tokens an engine output (a
    speculative step, or several merged) carried past it are not the completion's, in its usage
    or its log-probabilities (vLLM counts up to the token that completed the stop). The text
    not sent yet (``pending``: what is held back, then the new text) is all a step searches."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.stop = list(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.sent: list[str] = []
        self.pending = ""
        self.num_sent_chars = 0
        self.is_stopped = False
        self.stop_string: str | None = None
        """The stop string that ended the text (None while it goes on, or when no string did)."""

    @property
    def text(self) -> str:
        return "".join(self.sent) + self.pending

    def add(self, new_token_ids: Sequence[int], *, is_final: bool) -> str:
        """The text delta these tokens give (held back: a possible start of a stop string)."""
        if self.is_stopped:
            return ""
        ends = []  # the pending text's length after each new token
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.pending += self.detokenizer.add(token_id)
            ends.append(len(self.pending))
        if is_final:
            self.pending += self.detokenizer.flush()
            if ends:
                ends[-1] = len(self.pending)
        stop_at, stop_end = self._first_stop()
        if stop_at is not None:
            self.is_stopped = True
            self.stop_string = self.pending[stop_at:stop_end]
            num_kept = next((i for i, end in enumerate(ends) if end >= stop_end), len(ends) - 1) + 1
            del self.token_ids[len(self.token_ids) - len(ends) + num_kept:]
            self.pending = self.pending[:stop_at]
            end = stop_at
        else:
            end = len(self.pending) - (0 if is_final else self._num_held_back())
        delta, self.pending = self.pending[:end], self.pending[end:]
        if delta:
            self.sent.append(delta)
            self.num_sent_chars += len(delta)
        return delta

    def _first_stop(self) -> tuple[int | None, int]:
        """(where the first stop string begins in the pending text, where it ends), or (None, 0)."""
        best: tuple[int | None, int] = (None, 0)
        for s in self.stop:
            at = self.pending.find(s)
            if at >= 0 and (best[0] is None or at < best[0]):
                best = (at, at + len(s))
        return best

    def _num_held_back(self) -> int:
        """The longest pending suffix that could still begin a stop string."""
        for k in range(min(self.longest_stop - 1, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
