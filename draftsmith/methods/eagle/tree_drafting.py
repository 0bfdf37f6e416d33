"""EAGLE-2's dynamic draft tree (arXiv 2406.16858) from an EAGLE/EAGLE-3 head.

Drafting starts as a chain does: the catch-up's logits give the root's distribution, whose top-k tokens are
the depth-1 nodes. Each further depth feeds the `top_k` likeliest nodes of the last one (by cumulative draft
log-probability) to the head in one step, k queries a row, each node with the head state its parent's step
produced; each yields its top-k children. After `depth` depths, the `total` likeliest nodes of all are the
tree, likeliest first (a child is never likelier than its parent, and a tiny per-depth penalty breaks the
ties of probability 1): parents come before children, so the first w nodes are the w likeliest and still a
tree, which is how the engine sizes a step's tree (`serve.speculation.tree_verify.size_trees`).

In the head's cache, a node fed at depth d sits at `base + (d - 1) * top_k + j` (j: its place in that step),
so the nodes of one depth do not overwrite each other; its rotary position is that of its depth, `base + d -
1`. It attends to the row's verified context and to its ancestors' entries. The next catch-up overwrites the
positions the accepted path reaches; the rest lie past the verified prefix and are never read again.
"""

from __future__ import annotations

import torch

from draftsmith.methods.draft_trees import TreeShape, rerank, top_log_probs
from draftsmith.methods.token_tree import TokenTree
from draftsmith.models.kv_cache import ForwardBatch, KVCache


def _node_batch(slots: list[int], base: torch.Tensor, key_starts: torch.Tensor, written: torch.Tensor,
                ancestors: torch.Tensor, kv_start: int, kv_len: int) -> ForwardBatch:
    """One tree step's batch: row r's queries write at written [A, K] and see the row's context (keys from
    key_starts[r] up to base[r]) and the cache positions in ancestors [A, K, D] (-1: none); keys
    [kv_start, kv_len) are read (host values: no sync)."""
    rows, width = written.shape
    device = written.device
    keys = torch.arange(kv_start, kv_len, device=device)[None, None, :]
    context = (keys >= key_starts[:, None, None]) & (keys < base[:, None, None])
    tree = (keys[..., None] == ancestors[:, :, None, :]).any(-1)
    read_slots = torch.tensor(slots, device=device)
    return ForwardBatch(positions=written, read_slots=read_slots, write_slots=read_slots[:, None].expand(rows, width),
                        mask=(context | tree)[:, None], kv_len=kv_len, slot_start=None, kv_start=kv_start)


def draft_tree(head, cache: KVCache, shape: TreeShape, state: torch.Tensor, logits: torch.Tensor, slots: list[int],
               base: list[int], key_starts: list[int], stop_below: float = 0.0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    """A tree per row from the catch-up's head output state [A, H] and logits [A, draft_vocab], the row's
    next position `base` and first context key -> (target token ids [A, total], parents [A, total]: node
    index, -1 for the last verified token; the nodes' cumulative draft log-probabilities [A, total]; past
    the nodes made, -1, -1 and -inf). As a chain's drafting does (`Proposer.propose`'s), it goes no deeper
    once the rows' mean chance of the likeliest new node falls below `stop_below` (one host sync a depth)."""
    rows, k = state.shape[0], shape.top_k
    device = state.device
    log_probs, ids = top_log_probs(logits, k)
    tokens, scores = [head.to_target_ids(ids)], [log_probs]
    parents = [torch.full((rows, k), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(k, device=device).expand(rows, k)  # global candidate index of each fed node
    fed_tokens, fed_scores, fed_state = tokens[0], log_probs, state[:, None].expand(rows, k, state.shape[-1])
    base_t = torch.tensor(base, device=device)
    starts_t = torch.tensor(key_starts, device=device)
    ancestors = torch.full((rows, k, shape.depth), -1, dtype=torch.long, device=device)
    made = k
    for depth in range(1, shape.depth):
        written = base_t[:, None] + (depth - 1) * k + torch.arange(k, device=device)
        ancestors[:, :, depth - 1] = written
        batch = _node_batch(slots, base_t, starts_t, written, ancestors, min(key_starts), max(base) + depth * k)
        out, step_logits = head.step(fed_tokens, fed_state, (base_t + depth - 1)[:, None].expand(rows, k), False,
                                     cache, batch)
        log_probs, ids = top_log_probs(step_logits, k)  # [A, K fed, K children]
        child_scores = (fed_scores[:, :, None] + log_probs).reshape(rows, k * k)
        child_tokens = head.to_target_ids(ids).reshape(rows, k * k)
        tokens.append(child_tokens)
        scores.append(child_scores)
        parents.append(frontier[:, :, None].expand(rows, k, k).reshape(rows, k * k))
        made += k * k
        if depth + 1 == shape.depth or (stop_below > 0 and float(child_scores.max(-1).values.exp().sum())
                                        < stop_below * rows):
            break
        # feed the likeliest children next
        best = child_scores.topk(k, dim=-1).indices
        by = best // k  # the fed node each came from
        frontier = made - k * k + best
        fed_tokens, fed_scores = child_tokens.gather(1, best), child_scores.gather(1, best)
        fed_state = out.gather(1, by[:, :, None].expand(-1, -1, out.shape[-1]))
        ancestors = ancestors.gather(1, by[:, :, None].expand(-1, -1, shape.depth))
    return rerank(torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1), k, shape.total)


def draft_static_tree(head, cache: KVCache, tree: TokenTree, state: torch.Tensor, logits: torch.Tensor,
                      slots: list[int], base: list[int], key_starts: list[int]):
    """vLLM's static `speculative_token_tree` from the head: the node at path (r1, ..., rd) holds the rank-rd
    draft after its parent's path. Each depth feeds the nodes that have children in one head step, the n-th
    node fed at `base + n` in the head's cache; same outputs as `draft_tree`, in the tree's own order (parents
    first)."""
    rows, nodes = state.shape[0], tree.num_nodes
    device = state.device
    tokens = torch.full((rows, nodes), -1, dtype=torch.long, device=device)
    scores = torch.zeros(rows, nodes, device=device)
    base_t = torch.tensor(base, device=device)
    starts_t = torch.tensor(key_starts, device=device)
    children = [[c for c in range(nodes) if tree.parents[c] == i] for i in range(nodes)]
    written: dict[int, int] = {}  # fed node -> its offset past base in the head's cache
    fed_out: dict[int, torch.Tensor] = {}  # fed node -> the head's output [A, H] at it: its children's state
    _place(tokens, scores, head, logits[:, None], [c for c in range(nodes) if tree.parents[c] < 0], [0], tree,
           torch.zeros(rows, 1, device=device))
    for depth in range(1, tree.max_depth):
        fed = [i for i in range(nodes) if tree.depths[i] == depth and children[i]]
        if not fed:
            break
        for i in fed:
            written[i] = len(written)
        lineage = []  # every fed node's ancestors and itself, as cache offsets past base
        for i in fed:
            chain, at = [], i
            while at >= 0:
                chain.append(written[at])
                at = tree.parents[at]
            lineage.append(chain + [-1] * (tree.max_depth - len(chain)))
        offsets = torch.tensor(lineage, device=device)
        ancestors = torch.where(offsets >= 0, base_t[:, None, None] + offsets, -1)
        at = base_t[:, None] + torch.tensor([written[i] for i in fed], device=device)
        fed_state = torch.stack([state if tree.parents[i] < 0 else fed_out[tree.parents[i]] for i in fed], dim=1)
        batch = _node_batch(slots, base_t, starts_t, at, ancestors, min(key_starts), max(base) + len(written))
        out, step_logits = head.step(tokens[:, fed], fed_state, (base_t + depth - 1)[:, None].expand(rows, len(fed)),
                                     False, cache, batch)
        for n, i in enumerate(fed):
            fed_out[i] = out[:, n]
        _place(tokens, scores, head, step_logits, [c for i in fed for c in children[i]],
               [n for n, i in enumerate(fed) for _ in children[i]], tree, scores[:, fed])
    return tokens, tree.parent_tensor(rows, device), scores


def _place(tokens, scores, head, logits, nodes: list[int], source: list[int], tree: TokenTree, source_scores):
    """Writes `nodes`' tokens and cumulative scores: node n takes the rank-(its rank) draft of logits[:, source[n]]
    ([A, F, draft_vocab]), adding source_scores[:, source[n]]."""
    log_probs, ids = top_log_probs(logits, tree.top_k)  # [A, F, K]
    at = torch.tensor(source, device=logits.device)
    rank = torch.tensor([tree.ranks[n] for n in nodes], device=logits.device)
    index = torch.tensor(nodes, device=logits.device)
    tokens[:, index] = head.to_target_ids(ids[:, at, rank])
    scores[:, index] = source_scores[:, at] + log_probs[:, at, rank]
