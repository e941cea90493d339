"""The longest common subsequence of two token sequences, by its length only.

Predicted Outputs count the prediction tokens that appear in the completion, in order: the
length of the two sequences' longest common subsequence (LCS). The dynamic program is
O(n·m); this is Hyyrö's bit-parallel form of it (H. Hyyrö, "Bit-parallel LCS-length
computation revisited", 2004), one word-parallel add, subtract and two logic operations per
token of the longer sequence over a bit vector as long as the shorter one, so two 8,192-token
sequences cost milliseconds in Python's big integers and the count is exact.

    V = 1…1 (one bit per token of b)
    for each token t of a:  U = V & M[t];  V = (V + U) | (V − U)
    LCS = the number of zero bits of V             (M[t]: the positions of t in b)
"""

from __future__ import annotations

from typing import Sequence


def common_subsequence_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (exact)."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return 0
    masks: dict[int, int] = {}
    for position, token in enumerate(b):
        masks[token] = masks.get(token, 0) | (1 << position)
    full = (1 << len(b)) - 1
    v = full
    for token in a:
        m = masks.get(token)
        if m:
            u = v & m
            v = ((v + u) | (v - u)) & full
    return len(b) - bin(v).count("1")
