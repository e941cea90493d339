"""Token ids → text as they stream (serve/text/stream.py): the text equals the whole output's decode,
each delta is final (a prefix of that decode), and the work is linear in the output's length.

The cost is counted, not timed: a tokenizer that counts the tokens it is asked to decode shows
whether each new token costs a small window (incremental) or the whole output so far (what the
ingress did before: quadratic). The equality is checked on random token sequences, with a byte
tokenizer in miniature (fast) and with the real SmolLM2 tokenizer (its byte-level tokens split
multi-byte characters, and its special tokens are skipped).
"""

from __future__ import annotations

import random

import pytest

from cosine_ray.serve.generation import TextStream  # re-exported from serve.text.stream; on main too


class CountingByteTokenizer:
    """Byte-level in miniature: each id is a byte string; 9 and 10 are the two UTF-8 bytes of "é",
    11-13 the three of "€", 14 a lone continuation byte, 15 a special token (skipped)."""

    VOCAB = [b"a", b"b", b" ", b"S", b"T", b"O", b"P", b"x", b"\n", b"\xc3", b"\xa9", b"\xe2", b"\x82", b"\xac",
             b"\x80", b"<s>"]
    SPECIAL = {15}

    def __init__(self) -> None:
        self.num_decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.num_decoded += len(ids)
        kept = [i for i in ids if not (skip_special_tokens and i in self.SPECIAL)]
        return b"".join(self.VOCAB[i] for i in kept).decode("utf-8", errors="replace")


def stream_all(tokenizer, token_ids, chunk_sizes, stop=()) -> tuple[TextStream, list[str]]:
    ts, deltas, at = TextStream(tokenizer, stop), [], 0
    while at < len(token_ids):
        n = chunk_sizes.pop(0) if chunk_sizes else 1
        chunk = token_ids[at:at + n]
        at += n
        deltas.append(ts.add(chunk, is_final=at >= len(token_ids)))
        if ts.is_stopped:
            break
    return ts, deltas


def check_against_decode(tokenizer, ids: list[int], rng: random.Random) -> None:
    full = tokenizer.decode(ids, skip_special_tokens=True)
    sizes = [rng.choice((1, 1, 1, 2, 3, 7)) for _ in ids]
    ts, deltas = stream_all(tokenizer, ids, sizes)
    text = "".join(deltas)
    assert text == full == ts.text, (ids, text, full)
    sent = ""
    for delta in deltas:  # every delta is final: what was sent is a prefix of the whole text
        sent += delta
        assert full.startswith(sent), (ids, sent, full)


def test_random_byte_sequences_stream_to_their_whole_decode():
    rng = random.Random(0)
    tok = CountingByteTokenizer()
    for _ in range(3000):
        ids = [rng.randrange(len(tok.VOCAB)) for _ in range(rng.randrange(1, 24))]
        check_against_decode(tok, ids, rng)


def test_decoding_costs_linear_time_in_the_output():
    tok = CountingByteTokenizer()
    n = 2000
    rng = random.Random(1)  # text whose multi-byte characters are split across tokens
    ids = [t for _ in range(n // 4) for t in rng.choice(([0, 1], [9, 10], [11, 12, 13, 2], [7, 8]))][:n]
    ts, _ = stream_all(tok, ids, [1] * n, stop=["STOP", "\n\n"])
    assert ts.text == tok.decode(ids)
    tok.num_decoded = 0
    stream_all(tok, ids, [1] * n, stop=["STOP", "\n\n"])
    # incremental: a window of a few tokens per token (whole re-decodes would be ~n²/2 = 2,000,000)
    assert tok.num_decoded <= 12 * n, tok.num_decoded


def test_a_stop_string_in_one_large_output_is_found_in_linear_time():
    """One engine output may carry many tokens (a non-streamed response merges them): finding the
    token that completed the stop string must not decode every prefix of them."""
    tok = CountingByteTokenizer()
    n = 3000
    ids = [0, 2] * (n // 2) + [3, 4, 5, 6] + [1] * 50
    ts, deltas = stream_all(tok, ids, [len(ids)], stop=["STOP"])
    assert ts.is_stopped and ts.text == "a " * (n // 2) and "".join(deltas) == ts.text
    assert ts.token_ids == ids[:n + 4]  # up to the token that completed "STOP"
    assert tok.num_decoded <= 12 * len(ids), tok.num_decoded


def test_held_back_text_is_at_most_the_longest_stop_string_less_one():
    tok = CountingByteTokenizer()
    ts = TextStream(tok, ["STOP"])
    assert ts.add([0, 3, 4, 5], is_final=False) == "a"  # "STO" could begin "STOP"
    assert ts.pending == "STO"
    assert ts.add([0], is_final=False) == "STOa" and ts.pending == ""
    assert ts.add([3, 4, 5, 6, 1], is_final=False) == "" and ts.is_stopped and ts.text == "aSTOa"


@pytest.mark.real_model
def test_random_token_sequences_of_the_real_tokenizer_stream_to_their_whole_decode(real_checkpoint):
    tok = real_checkpoint.load_tokenizer()
    rng = random.Random(2)
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    single_bytes = [i for i, p in enumerate(pieces) if len(p) == 1]  # the byte tokens: partial characters
    special = list(tok.all_special_ids)
    # real text too: characters of several UTF-8 lengths, encoded by the tokenizer itself
    text_ids = tok("héllo wörld — ünïcode ✓ 你好 🙂 done", add_special_tokens=False)["input_ids"]
    for _ in range(400):
        ids = []
        for _ in range(rng.randrange(1, 40)):
            kind = rng.random()
            ids.append(rng.choice(single_bytes) if kind < 0.45 else rng.choice(special) if kind < 0.5
                       else rng.choice(text_ids) if kind < 0.7 else rng.randrange(len(tok)))
        check_against_decode(tok, ids, rng)
