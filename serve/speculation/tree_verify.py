"""Tree verification: one target forward scores every node of each row's draft tree, the longest path the
target agrees with is kept, and its keys and values move to their sequence positions.

Row b's block is [last verified token, node 0, node 1, ...] at cache positions start_b, start_b + 1, ...; node i
attends to the row's cached prefix and, inside the block, to its ancestors and itself (`ancestors`), with the
rotary position of its depth. The target's choice at every node is taken as plain decoding would take it at
that depth (argmax, or the exponential race with the noise of that sequence position); a node is accepted
when its token is its parent's choice and its parent is accepted. Siblings hold distinct tokens, so the
accepted nodes form one path: its tokens plus the choice at its end are what the step keeps, exactly what
plain decoding draws (lossless for greedy and sampled rows; drafts are deterministic, no q). The one copy a
tree needs: node i of depth d had its K/V written at start + 1 + i and needs it at start + d.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.llama import ForwardOutput
from draftsmith.serve.engine.logits_processing import DraftPrefix
from draftsmith.serve.engine.sampling import SamplingBatch, logits_to_probs, position_noise


def block_parents(parents: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (node index, -1 for the root), counts [B] real nodes -> [B, N + 1]: each block column's
    parent column (column 0 is the root, its own; padding nodes hang from the root)."""
    nodes = parents.shape[1]
    real = torch.arange(nodes, device=parents.device)[None, :] < counts[:, None]
    return torch.cat([torch.zeros_like(parents[:, :1]), torch.where(real, parents + 1, 0)], dim=1)


def ancestors(parent_cols: torch.Tensor) -> torch.Tensor:
    """[B, Q] parent columns -> [B, Q, Q] bool: query i sees key j when j is i or an ancestor of i."""
    rows, width = parent_cols.shape
    device = parent_cols.device
    seen = torch.eye(width, device=device).repeat(rows, 1, 1)
    seen[torch.arange(rows, device=device)[:, None], torch.arange(width, device=device)[None, :], parent_cols] = 1
    # reachability by squaring: after r rounds, ancestors up to 2^r levels up
    for _ in range(max(1, width.bit_length())):
        seen = (seen @ seen).clamp_(max=1)
    return seen.bool()


def tree_batch(slots: list[int], starts: list[int], q_lens: list[int], seen: torch.Tensor, cache: KVCache,
               sliding_window: int | None, device) -> tuple[ForwardBatch, torch.Tensor]:
    """The verify forward's batch for blocks at `starts` of q_lens real queries, and its rotary positions
    [B, Q] (start + depth)."""
    batch = ForwardBatch.build(slots, starts, q_lens, cache, sliding_window, device)
    start = torch.tensor(starts, device=device)
    width = seen.shape[-1]
    depth = seen.sum(-1) - 1  # a node's ancestors, itself and the root: depth + 1
    positions = (start[:, None] + depth).clamp(max=cache.max_len - 1)
    if batch.slot_rows is not None:  # the Triton kernel takes the tree mask as it is
        rows = replace(batch.slot_rows, tree_mask=seen, block_starts=start, positions=positions)
        return replace(batch, slot_rows=rows, causal=False), positions
    keys = torch.arange(batch.kv_start, batch.kv_len, device=device)[None, None, :]
    offset = keys - start[:, None, None]
    in_block = (offset >= 0) & (offset < width)
    tree = seen.gather(2, offset.clamp(0, width - 1).expand(seen.shape[0], width, -1))
    mask = torch.where(in_block, tree, offset < 0)
    if sliding_window is not None:
        mask &= keys > positions[:, :, None] - sliding_window
    return replace(batch, mask=mask[:, None], causal=False), positions  # the tree's mask, read


def tree_choices(logits: torch.Tensor, depth: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """Processed logits [B, Q, V] at the block's nodes, depth [B, Q] -> the token the target draws at each node [B, Q]:
    the argmax for greedy rows; for sampled ones the exponential race with the noise of the node's sequence
    position, so every node of one depth races with the same noise, as plain decoding would there."""
    greedy = logits.argmax(dim=-1)
    if sampling.all_greedy:
        return greedy
    probs = logits_to_probs(logits, sampling)
    noise = position_noise(sampling, int(depth.max()) + 1, logits.shape[-1], logits.device)
    noise = noise.gather(1, depth[:, :, None].expand(-1, -1, logits.shape[-1]))
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(sampling.temperature[:, None] > 0, drawn, greedy)


def accept_path(choice: torch.Tensor, ids: torch.Tensor, parent_cols: torch.Tensor, seen: torch.Tensor,
                counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choice, ids, parent_cols [B, Q] (the block: root, then nodes), seen [B, Q, Q], counts [B] real nodes ->
    (path [B, Q]: the accepted path's block columns by depth from the root, then -1; accepted [B]: its
    nodes)."""
    rows, width = ids.shape
    column = torch.arange(width, device=ids.device)
    # a node matches when its token is what the target draws at its parent; the root always does
    real = column[None, :] <= counts[:, None]
    match = ((ids == choice.gather(1, parent_cols)) & real) | (column[None, :] == 0)
    # accepted: every node on the way from the root matches
    accepted = ~(seen & ~match[:, None, :]).any(-1) & real
    depth = seen.sum(-1) - 1
    deepest = torch.where(accepted, depth, -1).argmax(-1)  # distinct siblings: one path
    on_path = seen[torch.arange(rows, device=ids.device), deepest]  # [B, Q]: the deepest node's ancestors
    order = torch.where(on_path, depth, width).argsort(-1)
    path = torch.where(on_path.gather(1, order), order, -1)
    return path, depth.gather(1, deepest[:, None])[:, 0]


def move_path(cache: KVCache, slots: list[int], starts: list[int], path: torch.Tensor, accepted: list[int]) -> None:
    """Moves the accepted nodes' keys and values from their block columns to their sequence positions."""
    src, dst, where = [], [], []
    host = path.tolist()
    for slot, start, cols, n in zip(slots, starts, host, accepted):
        for d in range(1, n + 1):
            if cols[d] != d:
                where.append(slot)
                src.append(start + cols[d])
                dst.append(start + d)
    if not where:
        return
    device = cache.k[0].device
    where_t, src_t, dst_t = (torch.tensor(x, device=device) for x in (where, src, dst))
    for layer in (*cache.k, *cache.v):
        layer[where_t, :, dst_t] = layer[where_t, :, src_t]  # read whole before written


def size_trees(drafts, rows: int, cost, sunk_seconds: float) -> int:
    """Cuts every row's tree to its first w nodes (its w likeliest: `DraftBatch.confidence`), w the one that
    maximises the step's expected tokens per second, as EAGLE-2 sizes its trees by the drafter's confidence:

        (rows + sum_rows sum_{j < w} confidence_j) / (drafting + F(rows, 1 + mean nodes) + host)

    with F the cost model's forward (a verify of more nodes costs more, the more so the more rows) and
    drafting already spent. w = 0 verifies nothing: a plain step. -> w."""
    counts = drafts.counts.tolist()
    gained = torch.cat([torch.zeros(1), drafts.confidence.sum(0).cpu().double().cumsum(0)]).tolist()
    best, best_rate = 0, 0.0
    for width in range(len(gained)):
        nodes = sum(min(width, n) for n in counts) / rows
        seconds = sunk_seconds + cost.forward(rows, 1 + nodes) + cost.host(rows, width > 0)
        rate = (rows + gained[width]) / seconds
        if rate > best_rate:
            best, best_rate = width, rate
    drafts.counts.clamp_(max=best)
    return best


def verify_tree(model, cache: KVCache, ids: torch.Tensor, slots: list[int], starts: list[int], q_lens: list[int],
                parents: torch.Tensor, sampling: SamplingBatch, feature_layers: tuple[int, ...]):
    """Scores the trees in one forward and keeps each row's accepted path -> (the forward's output at the path's
    columns (logits [B, D + 1, V], hidden states), tokens [B, D + 1]: the accepted drafts and the new token, -1
    after them, counts [B]: how many)."""
    device = ids.device
    counts = torch.tensor(q_lens, device=device) - 1
    parent_cols = block_parents(parents[:, : ids.shape[1] - 1].to(device), counts)
    seen = ancestors(parent_cols)
    batch, positions = tree_batch(slots, starts, q_lens, seen, cache, model.config.sliding_window, device)
    with torch.inference_mode():
        out = model(ids, positions=positions, cache=cache, batch=batch, feature_layers=feature_layers)
        processed = sampling.processed(out.logits, DraftPrefix.tree(ids, seen))
        choice = tree_choices(processed, seen.sum(-1) - 1, sampling)
        path, accepted = accept_path(choice, ids, parent_cols, seen, counts)
        # the path's columns as a chain: its logits and hidden states, so that what follows (features for the
        # drafter, logprobs) reads them as after a chain's verify
        longest = int(accepted.max()) + 1
        cols = path[:, :longest].clamp(min=0)
        logits = out.logits.gather(1, cols[:, :, None].expand(-1, -1, out.logits.shape[-1]))
        hidden = {i: h.gather(1, cols[:, :, None].expand(-1, -1, h.shape[-1])) for i, h in out.hidden_states.items()}
        drafted = ids.gather(1, cols)  # column 0: the root
        after_root = torch.cat([drafted[:, 1:], torch.full_like(drafted[:, :1], -1)], dim=1)
        tokens = torch.where(torch.arange(longest, device=device)[None, :] < accepted[:, None], after_root, -1)
        rows = torch.arange(ids.shape[0], device=device)
        tokens[rows, accepted] = choice.gather(1, path.gather(1, accepted[:, None]))[:, 0]
    move_path(cache, slots, starts, path, accepted.tolist())
    return ForwardOutput(logits=logits, hidden_states=hidden), tokens, accepted + 1
