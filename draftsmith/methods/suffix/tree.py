"""Suffix trees for suffix decoding (Arctic Inference's SuffixDecoding, arXiv 2411.04975), with its semantics.

A `SuffixTree` holds every substring of up to `max_depth` tokens of the sequences added to it, as paths from
the root. It is a trie, not path-compressed as Arctic's C++ tree is: the same proposals, but up to max_depth
nodes per varied token where Arctic keeps about one (`memory_bytes`, reported in the engine's metrics). Each
node counts the suffixes that reach it. From a node, the proposal follows the child with the highest count;
its estimated probability is the product of child count / parent count along the way, and it stops at the
token budget, at a leaf or once the probability falls below `min_token_prob`.

Ties among children of equal count go as in Arctic's sibling lists (suffix_tree.cc `_increment_count`,
`_decrement_count`, `_insert_into_siblings_after`): a new child goes last among its equals; a child whose
count rises goes first among its new equals if it was first among its old ones, else last; a child whose
count falls goes first among its new equals. Each node keeps a stamp that orders it among equal counts:
"first" takes a rising tick, "last" a falling one. Probabilities and scores are float32 sums, as there, so
that equal scores compare equal the same way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

F32 = np.float32


class _Node:
    __slots__ = ("token", "count", "stamp", "parent", "children", "best")

    def __init__(self, token: int, parent: _Node | None, stamp: int):
        self.token, self.parent, self.count, self.stamp = token, parent, 1, stamp
        self.children: dict[int, _Node] | None = None
        self.best: _Node | None = None  # the child a proposal follows


def _rank(node: _Node) -> tuple[int, int]:
    return node.count, node.stamp


class _Order:
    """Stamps that place a node first (above every stamp so far) or last (below every one) among equals."""

    def __init__(self):
        self.high, self.low = 0, 0

    def first(self) -> int:
        self.high += 1
        return self.high

    def last(self) -> int:
        self.low -= 1
        return self.low


def arctic_choice(followers: list[int]) -> tuple[int, int]:
    """(token, count) of the child Arctic follows, from the tokens that followed a node's occurrences, in the
    order they were appended: the highest count, ties by the sibling-list rules replayed."""
    counts: dict[int, int] = {}
    stamps: dict[int, int] = {}
    order = _Order()
    for token in followers:
        count = counts.get(token, 0)
        if count == 0:
            stamps[token] = order.last()
        else:
            first = not any(counts[t] == count and stamps[t] > stamps[token] for t in counts)
            stamps[token] = order.first() if first else order.last()
        counts[token] = count + 1
    token = max(counts, key=lambda t: (counts[t], stamps[t]))
    return token, counts[token]


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node(-1, None, 0)
        self.root.count = 0
        self.num_nodes = 1
        self.num_tokens = 0  # in all sequences held
        self._order = _Order()
        self._seqs: dict[int, list[int]] = {}
        self._active: dict[int, deque[_Node]] = {}  # per sequence: the nodes of its newest suffixes

    # -- building ---------------------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens) -> None:
        seq = self._seqs.setdefault(seq_id, [])
        active = self._active.setdefault(seq_id, deque())
        for token in tokens:
            token = int(token)
            active.append(self.root)
            self.root.count += 1
            if len(active) > self.max_depth:
                active.popleft()
            seq.append(token)
            self.num_tokens += 1
            for i, node in enumerate(active):
                active[i] = self._step_into(node, token)

    def _step_into(self, node: _Node, token: int) -> _Node:
        children = node.children
        child = children.get(token) if children is not None else None
        if child is None:
            child = _Node(token, node, self._order.last())
            if children is None:
                node.children = {}
            node.children[token] = child
            if node.best is None and node is not self.root:  # the root's best is never followed
                node.best = child
            self.num_nodes += 1
            return child
        if node is self.root:  # the order of the root's children is never read
            child.count += 1
            return child
        was_first = not any(c.count == child.count and c.stamp > child.stamp for c in children.values())
        child.count += 1
        child.stamp = self._order.first() if was_first else self._order.last()
        if child is not node.best and _rank(node.best) < _rank(child):
            node.best = child
        return child

    def remove(self, seq_id: int) -> None:
        """Takes a sequence's suffixes out again (the global tree's eviction)."""
        seq = self._seqs.pop(seq_id, None)
        self._active.pop(seq_id, None)
        self.num_tokens -= len(seq or ())
        for start in range(len(seq or ())):
            self.root.count -= 1
            path = seq[start : start + self.max_depth]
            parent = self.root
            for depth, token in enumerate(path):
                node = parent.children[token]
                node.count -= 1
                node.stamp = self._order.first()  # as Arctic: first among its new equals
                if node.count == 0:  # and so is every node below it on this path: the rest of the path
                    del parent.children[token]
                    self.num_nodes -= len(path) - depth
                if parent is not self.root and parent.best is node:
                    parent.best = max(parent.children.values(), key=_rank) if parent.children else None
                if node.count == 0:
                    break
                parent = node

    # -- matching -----------------------------------------------------------------------------------------
    def suffix_nodes(self, seq_id: int) -> list[_Node]:
        """The nodes of sequence `seq_id`'s newest suffixes, of lengths 1.. up to max_depth (shortest first)."""
        return list(reversed(self._active.get(seq_id, ())))

    def match(self, context: list[int]) -> list[_Node]:
        """nodes[m - 1] is where context[-m:] ends, for m = 1.. as long as it is in the tree."""
        nodes = []
        for m in range(1, len(context)):
            node = self.root
            for token in context[-m:]:
                node = node.children.get(token) if node.children else None
                if node is None:
                    return nodes
            nodes.append(node)
        return nodes

    def speculate(self, matched: list[_Node], max_tokens: int, factor: float, offset: float,
                  min_prob: float) -> Draft:
        """The best path draft from the nodes `match` found (Arctic's choice, `best_draft`)."""
        return best_draft(len(matched), lambda m, budget: _path(matched[m - 1], budget, min_prob), max_tokens,
                          factor, offset)

    def memory_bytes(self) -> int:
        """About what the tree holds: a node with its slot in its parent's dict, and the sequences' tokens.
        Uncompressed, a varied output of n tokens takes up to n * max_depth nodes (Arctic's C++ tree compresses
        chains, about one node per token): hence the metric."""
        return self.num_nodes * 200 + self.num_tokens * 8


def best_draft(num_matched: int, path, max_tokens: int, factor: float, offset: float) -> Draft:
    """Arctic's choice over match lengths m = 1..num_matched: the path draft (`path(m, budget)`) of highest
    score, the longest match winning ties, each m drafting at most factor * m + offset tokens. Longest first,
    so that shorter matches whose budget cannot beat the best stop the search."""
    best = Draft()
    for m in range(num_matched, 0, -1):
        budget = max(min(max_tokens, int(float(F32(F32(m) * F32(factor) + F32(offset))) + 1e-6)), 0)
        if budget <= best.score:  # a draft of n tokens scores at most n
            break
        draft = path(m, budget)
        if draft.score > best.score:
            draft.match_len = m
            best = draft
    return best


class OwnSequence:
    """One request's own tokens (prompt and output), searched directly for what Arctic's per-request suffix
    tree answers, without building it: a tree costs max_depth nodes per token to build (38 ms for a prompt of
    400 varied tokens here), the search costs a pass over the occurrences of the context's last token.

    A node of that tree at depth d is the occurrences of its path (their end positions); its count is how
    many, its children the tokens that follow them within the depth, whose order among equal counts is
    Arctic's sibling-list rules replayed over the occurrences in order (`arctic_choice`)."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.tokens: list[int] = []  # read token by token while drafting
        self._array = np.empty(256, dtype=np.int64)  # the same, appended in place, for the vectorized match

    def extend(self, tokens) -> None:
        start = len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        if len(self.tokens) > len(self._array):
            grown = np.empty(max(2 * len(self._array), len(self.tokens)), dtype=np.int64)
            grown[:start] = self._array[:start]
            self._array = grown
        self._array[start : len(self.tokens)] = self.tokens[start:]

    def speculate(self, max_tokens: int, factor: float, offset: float, min_prob: float) -> Draft:
        seq, length = self.tokens, len(self.tokens)
        # ends[m - 1]: where the occurrences of the context's last m tokens end (the context is the newest
        # min(length, max_depth) tokens, matched over lengths 1..its length - 1, as Arctic does)
        longest = min(length, self.max_depth) - 1
        if longest < 1:
            return Draft()
        ends = [np.flatnonzero(self._array[:length] == seq[-1]).tolist()]
        while len(ends) < longest and len(ends[-1]) > 1:  # only the context itself left: nothing follows
            m = len(ends) + 1
            want = seq[length - m]
            ends.append([e for e in ends[-1] if e >= m - 1 and seq[e - m + 1] == want])
        return best_draft(len(ends), lambda m, budget: self._path(ends[m - 1], m, budget, min_prob), max_tokens,
                          factor, offset)

    def _path(self, ends: list[int], depth: int, budget: int, min_prob: float) -> Draft:
        seq, length = self.tokens, len(self.tokens)
        draft, prob, score, count, floor = Draft(), F32(1.0), F32(0.0), len(ends), F32(min_prob)
        while len(draft.tokens) < budget and depth < self.max_depth:
            follow = [e + 1 for e in ends if e + 1 < length]  # where the followers sit, in order
            if not follow:
                break
            token, top = arctic_choice([seq[f] for f in follow])
            at = [f for f in follow if seq[f] == token]
            prob = F32(prob * (F32(top) / F32(count)))
            if prob < floor:
                break
            draft.tokens.append(token)
            draft.probs.append(float(prob))
            score = F32(score + prob)
            ends, count, depth = at, top, depth + 1
        draft.score = float(score)
        return draft

    def memory_bytes(self) -> int:
        return len(self.tokens) * 36  # a list slot and a small int, plus the array copy


def _path(node: _Node, budget: int, min_prob: float) -> Draft:
    draft, prob, score = Draft(), F32(1.0), F32(0.0)
    while len(draft.tokens) < budget:
        child = node.best
        if child is None:
            break
        prob = F32(prob * (F32(child.count) / F32(node.count)))
        if prob < F32(min_prob):
            break
        draft.tokens.append(child.token)
        draft.probs.append(float(prob))
        score = F32(score + prob)
        node = child
    draft.score = float(score)
    return draft
