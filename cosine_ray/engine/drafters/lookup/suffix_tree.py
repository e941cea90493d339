"""The implicit suffix tree below a match: what the suffix drafter walks to draft.

A match of a request's context in a ``SuffixIndex`` (the *anchor*: its source index, match
length and the continuation windows of the occurrences that matched) is the root of a tree
whose nodes are the occurrences that also continue with a given prefix. Nodes are built on
demand and cached per anchor.

Drafts walk *down* from the anchor (the occurrences that matched the context
keep being followed: the suffix tree's path), they never re-match mid-draft. So
``continue_drafts(prefix)`` answers the children of the anchor's node at ``prefix`` ([] once
the prefix leaves the tree, passes the length cap or the probability cut), ``continue_chains``
is the same walk level by level, and ``propose``'s first path is that chain. The anchor and
every walked node are cached per request until its context or the global index changes,
so the fusion rounds of one step cost a dictionary lookup each.

Confidences are empirical probabilities in [0, 1]: count of the child / (count of the node's
occurrences that have a next token + ``count_smoothing``).
"""

from __future__ import annotations

from cosine_ray.engine.drafters.base import Candidates, by_count


class SuffixNode:
    """A node of the implicit suffix tree below an anchor: the occurrences that continue
    the anchor's match with ``prefix``; ``rows`` are their continuation windows."""

    __slots__ = ("rows", "depth", "cumulative", "_ranked", "_denominator")

    def __init__(self, rows: list[list[int]], depth: int, cumulative: float) -> None:
        self.rows, self.depth, self.cumulative = rows, depth, cumulative
        self._ranked: list[tuple[int, int]] | None = None
        self._denominator = 0.0

    def ranked(self, smoothing: float) -> tuple[list[tuple[int, int]], float]:
        """``[(token, count)]`` most frequent first (ties: most recent), and the denominator."""
        if self._ranked is None:
            counts: dict[int, int] = {}
            t = self.depth
            for w in self.rows:  # rows are most recent first: dict order breaks ties
                tok = w[t]
                if tok >= 0:
                    counts[tok] = counts.get(tok, 0) + 1
            self._ranked = sorted(counts.items(), key=by_count, reverse=True)
            self._denominator = sum(counts.values()) + smoothing
        return self._ranked, self._denominator


class Anchor:
    """The winning match of one request's context: its node and the walked nodes below."""

    __slots__ = ("source", "match_len", "max_len", "score", "_nodes", "_smoothing")

    def __init__(self, source: str, match_len: int, max_len: int, rows: list[list[int]], smoothing: float) -> None:
        self.source, self.match_len, self.max_len, self.score = source, match_len, max_len, 0.0
        self._smoothing = smoothing
        self._nodes: dict[tuple[int, ...], SuffixNode | None] = {(): SuffixNode(rows, 0, 1.0)}

    def node(self, prefix: tuple[int, ...]) -> SuffixNode | None:
        """The node at ``prefix`` below the anchor (None once the prefix leaves the tree)."""
        nodes = self._nodes
        if prefix in nodes:
            return nodes[prefix]
        i = len(prefix) - 1
        while prefix[:i] not in nodes:
            i -= 1
        node = nodes[prefix[:i]]
        while i < len(prefix):
            node = self._child(node, prefix[i])
            i += 1
            nodes[prefix[:i]] = node
        return node

    def _child(self, node: SuffixNode | None, token: int) -> SuffixNode | None:
        if node is None or node.depth >= self.max_len:
            return None
        ranked, denominator = node.ranked(self._smoothing)
        count = next((c for tok, c in ranked if tok == token), 0)
        if count == 0:
            return None
        t = node.depth
        return SuffixNode([w for w in node.rows if w[t] == token], t + 1, node.cumulative * (count / denominator))

    def candidates(self, prefix: tuple[int, ...], k: int, min_token_prob: float) -> Candidates:
        """Up to k ``(token, probability)`` children of ``prefix``'s node within the cuts."""
        node = self.node(prefix)
        if node is None or node.depth >= self.max_len or k <= 0:
            return []
        ranked, denominator = node.ranked(self._smoothing)
        out = []
        for tok, count in ranked[:k]:
            prob = count / denominator
            if node.cumulative * prob < min_token_prob:
                break
            out.append((tok, prob))
        return out

    def greedy_score(self, min_token_prob: float) -> float:
        """Sum of cumulative probabilities along the most likely path (the paper's score).

        The same walk as ``candidates`` with k=1, inlined: it runs for every match length
        tried and most of them lose, so it fills no node cache."""
        rows, smoothing, max_len = self._nodes[()].rows, self._smoothing, self.max_len
        cumulative, score, t = 1.0, 0.0, 0
        while t < max_len:
            if len(rows) == 1:  # one occurrence left: its window, at 1 / (1 + smoothing) a token
                prob, window = 1.0 / (1.0 + smoothing), rows[0]
                while t < max_len and window[t] >= 0 and cumulative * prob >= min_token_prob:
                    cumulative *= prob
                    score += cumulative
                    t += 1
                break
            counts: dict[int, int] = {}
            for w in rows:
                tok = w[t]
                if tok >= 0:
                    counts[tok] = counts.get(tok, 0) + 1
            if not counts:
                break
            tok, count = max(counts.items(), key=by_count)  # first maximum: the most recent
            cumulative *= count / (sum(counts.values()) + smoothing)
            if cumulative < min_token_prob:
                break
            score += cumulative
            rows = [w for w in rows if w[t] == tok]
            t += 1
        self.score = score
        return score
