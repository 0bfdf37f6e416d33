"""Log probabilities of the tokens a request generates, and of the most likely alternatives (vLLM's shapes).

They come from the target's distribution at each generated position: from the decode forward that sampled
the token, or, when speculating, from the verify forward's logits at the position where the token was
accepted or drawn. That forward scores the same context, so a token's logprob is the same with and without
speculation (up to float rounding of a wider forward), whatever the draft proposed; a token drawn from the
rejection sampler's residual distribution still reports the target's logprob, as vLLM does.

`logprobs_mode` follows vLLM: `raw_logprobs` (the default) is log_softmax of the model's logits;
`processed_logprobs` is the log of the distribution the request samples from, after its penalties, biases and
bans (`logits_processing`), temperature, min_p, top-k and top-p (tokens filtered out get -inf; greedy rows
use temperature 1 there, as the sampler does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.serve.engine.logits_processing import DraftPrefix
from draftsmith.serve.engine.sampling import SamplingBatch, logits_to_probs

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token at that position


# per generated token: {token id: Logprob}, the generated token first, then the top alternatives by rank
TokenLogprobs = dict[int, Logprob]


def position_logprobs(logits: torch.Tensor, sampling: SamplingBatch, mode: str, rows: list[int]) -> torch.Tensor:
    """logits [B, N, V] -> log probabilities [len(rows), N, V] of those rows in `mode` (see the module
    docstring)."""
    index = torch.tensor(rows, device=logits.device)
    if mode == "processed_logprobs":  # the sampling settings are per row of the whole batch
        return logits_to_probs(logits.float(), sampling)[index].log()
    return torch.log_softmax(logits[index].float(), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, rows: list[int], positions: list[int], tokens: list[int],
                    top_n: list[int]) -> list[TokenLogprobs]:
    """For each (row, position, token, top_n): the token's logprob and rank and the top_n most likely tokens
    there, read from `logprobs` [B, N, V] with one device-to-host copy."""
    if not rows:
        return []
    device = logprobs.device
    picked = logprobs[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]  # [T, V]
    chosen = torch.tensor(tokens, device=device)
    chosen_lp = picked.gather(1, chosen[:, None])[:, 0]
    rank = (picked > chosen_lp[:, None]).sum(1) + 1
    widest = max(top_n)
    top_lp, top_ids = picked.topk(widest, dim=-1) if widest else (picked[:, :0], chosen[:, None][:, :0])
    # one copy for all four; token ids survive the float trip (exact below 2**24, vocabularies are smaller)
    host = torch.cat([chosen_lp[:, None], rank[:, None].float(), top_lp, top_ids.float()], dim=1).tolist()
    out = []
    for token, n, row in zip(tokens, top_n, host):
        entry = {token: Logprob(row[0], int(row[1]))}
        for r in range(n):
            alternative = int(row[2 + widest + r])
            if alternative not in entry:
                entry[alternative] = Logprob(row[2 + r], r + 1)
        out.append(entry)
    return out


def prompt_logprobs(rows, chunks: list[int], logits: torch.Tensor, scored: list[int], sampling: SamplingBatch,
                    mode: str) -> None:
    """Appends to the `scored` requests' prompt logprobs those of the prompt tokens that a prefill chunk's
    positions predict (`rows`: the chunk's requests, logits [B, width, V]: position j scores the prompt token
    after it)."""
    index = []  # (row among `scored`, position, the prompt token it predicts, top alternatives)
    for at, i in enumerate(scored):
        request, start = rows[i], rows[i].num_computed
        for j in range(min(chunks[i], request.prompt_len - 1 - start)):
            index.append((at, j, request.prompt_token_ids[start + j + 1], request.params.prompt_logprobs))
    if not index:
        return
    entries = gather_logprobs(position_logprobs(logits, sampling, mode, scored), *map(list, zip(*index)))
    for (at, *_), entry in zip(index, entries):
        rows[scored[at]].prompt_logprobs.append(entry)


def token_logprobs(rows, new_tokens: list[list[int]], logits: torch.Tensor, sampling: SamplingBatch,
                   mode: str) -> list[list[TokenLogprobs] | None]:
    """Per request of `rows`, the logprob entries of its new tokens (row b's token j was chosen at logits[b,
    j]), or None for requests that did not ask; nothing is computed when none did."""
    wanted = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return [None] * len(rows)
    index = [(i, j, token, rows[b].params.logprobs) for i, b in enumerate(wanted) for j, token in enumerate(new_tokens[b])]
    with torch.inference_mode():
        if mode == "processed_logprobs" and sampling.adjust is not None:  # token j came after tokens 0..j-1
            width = logits.shape[1]
            kept = torch.tensor([(tokens + [-1] * width)[:width] for tokens in new_tokens], device=logits.device)
            logits = sampling.processed(logits, DraftPrefix.chain(kept, width) if width > 1 else None)
        entries = gather_logprobs(position_logprobs(logits, sampling, mode, wanted), *map(list, zip(*index)))
    out: list[list[TokenLogprobs] | None] = [None] * len(rows)
    at = 0
    for b in wanted:
        out[b], at = entries[at : at + len(new_tokens[b])], at + len(new_tokens[b])
    return out
