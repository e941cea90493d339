"""An llguidance tokenizer of the fakes' vocabulary (``support.fakes.VOCAB`` = 48 tokens), built
in code: one character a token (digits, lower-case letters, JSON punctuation, a blank), the rest
unused, and EOS last. Grammars compile against it in milliseconds, so engine tests over the
``TableTarget`` can run real llguidance matchers."""

from __future__ import annotations

from support.fakes import VOCAB

CHARS = '0123456789abcdefghijklmnopqrstuvwxyz{}[]":, '
"""Token i is ``CHARS[i]`` for i < len(CHARS)."""
EOS = VOCAB - 1


class _Tokens:
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]
    tokens = [c.encode() for c in CHARS] + [b"\x00"] * (VOCAB - 1 - len(CHARS)) + [b"<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return [CHARS.index(chr(b)) for b in text]


def grammar_tokenizer():
    """The ``llguidance.LLTokenizer`` (``GrammarCompiler`` takes it as it is)."""
    import llguidance
    from llguidance._tokenizer import TokenizerWrapper

    return llguidance.LLTokenizer(TokenizerWrapper(_Tokens()), n_vocab=VOCAB)


def decode(token_ids) -> str:
    return "".join(CHARS[t] for t in token_ids if t < len(CHARS))
