"""Grammar drafts: where a row's structured-output grammar allows one token alone for a stretch (a required key
and its `": "`, the rest of an enum value), those tokens are drafts that cost nothing to make and that the target
cannot reject (its processed logits allow nothing else there). A step that would decode plainly (no
speculation, a plan of 0, a held policy) verifies them instead: one forward of [last token, forced tokens]
gives all of them and the token after, where plain decoding would give one token a forward.

It is still verification, not a shortcut: the target's choice at each position is taken exactly as plain
decoding takes it (`sampling.choose_tokens` over the processed logits), so the output is plain decoding's,
penalties and bans included, whatever the grammar forced.
"""

from __future__ import annotations

import torch

from draftsmith.serve.engine.logits_processing import DraftPrefix
from draftsmith.serve.engine.sampling import SamplingBatch, choose_tokens
from draftsmith.serve.speculation.verify import keep_matching

MAX_FORCED = 16  # forced tokens one step verifies at most: a verify of 17 tokens still costs about one decode here


def forced_limits(rows: list, max_model_len: int, most: int = MAX_FORCED) -> list[int]:
    """The most forced tokens each row may verify: `most`, less where its max_tokens and the context leave
    less room past its next token."""
    limits = []
    for r in rows:
        left = r.params.max_tokens - len(r.output_token_ids) - 1 if r.params.max_tokens else most
        limits.append(max(0, min(most, left, max_model_len - r.num_tokens - 1)))
    return limits


def forced_step(engine, rows: list, forced: list[list[int]], started: float, sampling: SamplingBatch,
                draft_s: float = 0.0) -> None:
    """Verifies each row's forced tokens (none for rows without) in one target forward and keeps what plain
    decoding would have produced: the forced tokens and the token after them."""
    counts = [len(f) for f in forced]
    width = 1 + max(counts)
    drafts = torch.full((len(rows), width - 1), -1, dtype=torch.long)
    for row, tokens in enumerate(forced):
        drafts[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    ids = torch.cat([torch.tensor([[r.last_token] for r in rows]), drafts.clamp(min=0)], dim=1)
    q_lens = [1 + n for n in counts]
    out, forward_at = engine.step_forward(ids, rows, q_lens)
    verify_at = engine.clock()
    with torch.inference_mode():
        device = out.logits.device
        draft_tokens = drafts.to(device)
        logits = sampling.processed(out.logits[:, :width], DraftPrefix.chain(draft_tokens, width))
        tokens, kept = keep_matching(choose_tokens(logits, sampling), draft_tokens, torch.tensor(counts, device=device))
        packed = torch.cat([tokens, kept[:, None]], dim=1).tolist()
    verified_at = engine.clock()
    kept = [row[-1] for row in packed]
    new_tokens = [row[:n] for row, n in zip(packed, kept)]
    engine.observe_features(rows, [r.num_tokens - 1 for r in rows], kept, out)
    engine.take_tokens(rows, new_tokens, out.logits, sampling)
    for request in rows:
        request.num_computed = request.num_tokens - 1
    engine.stats["num_forced_tokens"] += sum(kept) - len(rows)
    # booked as a plain step of longer rows: no drafter ran for these tokens
    engine._account(rows, 0, started, draft_s, verify_at - forward_at, verified_at - verify_at,
                    query_len=sum(q_lens) / len(rows))
