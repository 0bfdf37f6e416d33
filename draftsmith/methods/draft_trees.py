"""What drafting a dynamic tree shares (EAGLE-2, arXiv 2406.16858): its shape, the top-k draft
log-probabilities, and the rerank that keeps the `total` likeliest candidates, likeliest first, so that the
first w nodes are the w likeliest and still a tree (how the engine sizes a step's tree:
`serve.speculation.tree_verify.size_trees`).

And trees from drafters that draft every depth in one pass (a DFlash block, Medusa's heads): depth d's
distribution does not depend on the drafts before it, so every node of depth d - 1 has the same candidate
children, depth d's top-k tokens. `marginal_tree` grows EAGLE-2's tree from those marginals without a draft
step per depth (a node's score is the sum of its path's log-probabilities, the chance its path is accepted
were the depths independent); `static_marginal_tree` reads vLLM's static `speculative_token_tree` from them
(Medusa's candidate tree).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from draftsmith.methods.token_tree import TokenTree

# subtracted per depth from a node's score: a child whose draft probability rounds to 1 still ranks below
# its parent, so the rerank never keeps a node without its parent
DEPTH_PENALTY = 1e-4


@dataclass(frozen=True)
class TreeShape:
    depth: int
    top_k: int
    total: int  # nodes verified

    @property
    def max_depth(self) -> int:  # as TokenTree's
        return self.depth

    @property
    def cache_room(self) -> int:
        """Head cache positions an EAGLE tree needs past the verified prefix."""
        return max(self.depth - 1, 1) * self.top_k


def configured_tree(config, total: int) -> TokenTree | TreeShape | None:
    """The tree a speculative config asks for: vLLM's static `speculative_token_tree`, EAGLE-2's dynamic
    `tree_depth`/`tree_top_k` of at most `total` nodes, or None (a chain)."""
    depth = getattr(config, "tree_depth", None)
    if getattr(config, "speculative_token_tree", None):
        return config.token_tree()
    return None if depth is None else TreeShape(depth, config.tree_top_k, total)


def top_log_probs(logits: torch.Tensor, k: int):
    """The k likeliest draft ids and their log-probabilities: top-k of the logits less their logsumexp, not a
    whole log-softmax written out first."""
    top = logits.topk(k, dim=-1)
    return top.values.float() - torch.logsumexp(logits.float(), -1, keepdim=True), top.indices


def rerank(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, k: int, total: int):
    """Candidates laid out as k of depth 1, then k * k per further depth (the children of that depth's k
    expanded nodes) -> the `total` likeliest, likeliest first: (tokens, parents as indices among them, their
    cumulative draft log-probabilities); -1, -1, -inf past the candidates made."""
    rows, made = tokens.shape
    device = tokens.device
    index = torch.arange(made, device=device)
    depth = torch.where(index < k, 0, (index - k) // (k * k) + 1)
    taken = min(total, made)  # fewer where drafting stopped early
    chosen = (scores - DEPTH_PENALTY * depth).topk(taken, dim=-1, sorted=True).indices
    where = torch.full((rows, made), -1, dtype=torch.long, device=device)
    where.scatter_(1, chosen, torch.arange(taken, device=device).expand(rows, taken))
    parent = parents.gather(1, chosen)
    out = (tokens.gather(1, chosen), torch.where(parent >= 0, where.gather(1, parent.clamp(min=0)), -1),
           scores.gather(1, chosen))
    if taken == total:
        return out
    pad = total - taken
    return tuple(torch.cat([t, torch.full((rows, pad), fill, dtype=t.dtype, device=device)], dim=1)
                 for t, fill in zip(out, (-1, -1, float("-inf"))))


def marginal_tree(logits: torch.Tensor, shape: TreeShape):
    """logits [A, D, V] of depths 1..D (D >= shape.depth) -> EAGLE-2's tree of `shape`: each depth expands the
    top_k likeliest nodes of the last into depth d's top_k tokens each, and the `total` likeliest of all
    candidates are kept (`rerank`): (tokens, parents, cumulative log-probabilities), each [A, total]."""
    rows, k = logits.shape[0], shape.top_k
    device = logits.device
    log_probs, ids = top_log_probs(logits[:, : shape.depth], k)  # [A, D, k]
    tokens, scores = [ids[:, 0]], [log_probs[:, 0]]
    parents = [torch.full((rows, k), -1, dtype=torch.long, device=device)]
    frontier, fed_scores, made = torch.arange(k, device=device).expand(rows, k), log_probs[:, 0], k
    for depth in range(1, shape.depth):
        child_scores = (fed_scores[:, :, None] + log_probs[:, depth, None, :]).reshape(rows, k * k)
        tokens.append(ids[:, depth, None, :].expand(rows, k, k).reshape(rows, k * k))
        scores.append(child_scores)
        parents.append(frontier[:, :, None].expand(rows, k, k).reshape(rows, k * k))
        made += k * k
        best = child_scores.topk(k, dim=-1).indices
        frontier, fed_scores = made - k * k + best, child_scores.gather(1, best)
    return rerank(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), k, shape.total)


def static_marginal_tree(logits: torch.Tensor, tree: TokenTree, width: int | None = None) -> torch.Tensor:
    """logits [A, D, V] of depths 1..D (D >= the depth of the tree's first `width` nodes, all by default) -> the
    tokens [A, width] of those nodes: the node at path (r1, ..., rd) holds depth d's rank-rd token. (A static
    tree is verified whole: no scores.)"""
    width = tree.num_nodes if width is None else width
    top = logits.topk(min(tree.top_k, logits.shape[-1]), dim=-1).indices  # [A, D, k]
    return top[(slice(None), *_node_index(tree, width, logits.device))]


@functools.lru_cache(maxsize=32)
def _node_index(tree: TokenTree, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `width` nodes' depths - 1 and ranks as index tensors, built once per tree (not every step)."""
    return (torch.tensor(tree.depths[:width], device=device) - 1, torch.tensor(tree.ranks[:width], device=device))
