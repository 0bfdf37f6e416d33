"""The served walk the training evals report (`methods.served_walk`): what a server's steps accept along a
text, read off teacher-forced chains."""

from __future__ import annotations

import torch

from draftsmith.methods.eagle.training import chain_lengths, simulated_acceptance, target_logits
from draftsmith.methods.served_walk import served_walk, walk_rows
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve import LLM, SamplingParams
from draftsmith.train.objectives import target_features
from helpers import CODE_PROMPTS, DEMO_MODEL, REPO, spec_config

EAGLE3 = REPO / "assets" / "demo-code-7m-eagle3"


def test_a_walk_steps_past_each_chain_and_restarts_after_a_gap():
    # row 0: chains of 2 at 0, 0 at 3, 1 at 4; the walk visits 0, 3, 4, 6 (no chain: stops)
    lengths = torch.tensor([[2, 9, 9, 0, 1, 9, 9, 9], [1, 9, 0, 9, 9, 3, 9, 9]])
    starts = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert served_walk({t: int(n) for t, n in enumerate(lengths[0][:6])}, 0) == [2, 0, 1]
    # row 1: from 0 (1 right) to 2 (none right) to 3, no start: the gap; again from 5 (3 right) to 9, past the
    # row. Each step yields its right drafts and the target's own token.
    tokens, steps = walk_rows(lengths, starts)
    assert steps == 3 + 3 and tokens == (2 + 0 + 1) + 3 + (1 + 0 + 3) + 3, (tokens, steps)


def test_the_eagle_walk_is_what_the_engine_accepts(target):
    """The walk over the engine's own greedy output, from teacher-forced chains at every position, accepts what
    the engine accepted step by step (the shipped EAGLE-3 head, k = 4, fp32 drafts; a prompt short enough
    that the head's served context holds all of it), and the eval's totals are that walk's."""
    config = spec_config("eagle3", EAGLE3, 4, draft_dtype="float32")
    llm = LLM(DEMO_MODEL, speculative_config=config, dtype="float32", device="cpu", max_num_seqs=2,
              max_model_len=256)
    steps = []
    observe = llm.engine.spec_metrics.observe
    llm.engine.spec_metrics.observe = lambda *step: steps.append(step) or observe(*step)
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[1], add_special_tokens=False).input_ids
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    ids = torch.tensor([prompt + list(out[0].outputs[0].token_ids)])
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, len(prompt):] = 1  # the first chain is anchored at the prompt's last position
    head = llm.engine.proposer.head
    batch = {"input_ids": ids, "loss_mask": loss_mask, "lengths": torch.tensor([ids.shape[1]])}
    with torch.no_grad():
        feats = target_features(target, head.feature_layers, ids, "float32")
        greedy = target_logits(target, feats["last"][:, 1:]).argmax(-1)
        lengths = chain_lengths(head, ids, feats, greedy, 4)
        _, _, tokens, walked = simulated_acceptance(head, target, batch, feats, 4)
    walk = served_walk(dict(enumerate(lengths[0].tolist())), len(prompt) - 1)
    full = [accepted for drafted, accepted in steps if drafted == 4]
    assert len(full) >= 8 and walk[: len(full)] == full, (walk, steps)
    assert 0 < sum(full) < 4 * len(full)  # neither all wrong nor all right: the walk's anchors are exercised
    # the eval walks the same steps up to its last chain start (max_k positions before the row's end)
    assert walked <= len(walk) and tokens == sum(walk[:walked]) + walked
