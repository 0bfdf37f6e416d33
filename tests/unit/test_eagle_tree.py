"""EAGLE-2 dynamic draft trees from the demo EAGLE-3 head (methods.eagle.tree_drafting): every node's score is
what the head drafting a chain along that node's path gives it (tree masks, depth positions and parent states
in the head's own cache), the kept nodes are the likeliest with their parents, and served trees decode
greedily and sample (seeded) exactly what plain decoding does, accepting more per step than a chain."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.eagle import proposer as proposer_module
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import CODE_PROMPTS, DEMO_MODEL, assert_samples_as_plain, greedy_acceptance_lengths, spec_config

EAGLE3_HEAD = DEMO_MODEL.parent / "demo-code-7m-eagle3"


def _spec(**keys):
    # a float32 head: the chain oracle below reads keys in another layout, and bfloat16 rounds by layout
    return spec_config("eagle3", EAGLE3_HEAD, draft_dtype="float32", **keys)


def _llm(target, **keys):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
               speculative_config=_spec(**keys))


@pytest.mark.parametrize("keys,message", [
    ({"num_speculative_tokens": 8, "tree_depth": 4}, "tree_depth and tree_top_k go together"),
    ({"num_speculative_tokens": 12, "tree_depth": 2, "tree_top_k": 2}, "has 6 candidates: num_speculative_tokens=12"),
    ({"num_speculative_tokens": 8, "tree_depth": 4, "tree_top_k": 2, "num_speculative_tokens_per_batch_size": [[1, 4, 4]]},
     "cannot be combined with num_speculative_tokens_per_batch_size"),
    ({"num_speculative_tokens": 8, "tree_depth": 4, "tree_top_k": 2, "draft_sample_method": "probabilistic"},
     "must be greedy"),
    ({"num_speculative_tokens": 2, "tree_depth": 2, "tree_top_k": 1, "speculative_token_tree": "[(0,), (0, 0)]"},
     "exclude each other"),
])
def test_bad_tree_keys_are_one_clear_error(keys, message):
    with pytest.raises(DraftsmithError, match=message):
        parse_speculative_config(_spec(**keys))


def _chain_scores(head, cache, slot, base, key_start, state, logits, path):
    """The head drafting a chain along `path` (target ids) from the catch-up's state and logits: the
    cumulative log-probability of each token of the path."""
    to_draft = {int(t): d for d, t in enumerate(head.to_target_ids(torch.arange(head.draft_vocab_size)))}
    total, scores = 0.0, []
    for depth, token in enumerate(path):
        total += float(torch.log_softmax(logits.float(), -1)[to_draft[token]])
        scores.append(total)
        if depth + 1 == len(path):
            break
        batch = ForwardBatch.build([slot], [base + depth], [1], cache, None, "cpu", key_starts=[key_start])
        out, step_logits = head.step(torch.tensor([[token]]), state[None, None], batch.positions, False, cache, batch)
        state, logits = out[0, 0], step_logits[0, 0]
    return scores


STATIC_TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]"


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_tree_nodes_score_as_the_chain_along_their_path(target, monkeypatch, static):
    """Each node of the trees drafted while serving (3 rows, one of them a long prompt whose head context
    starts mid-sequence) carries the cumulative log-probability the head gives its path when drafting that
    path as a chain; parents come first and are likelier than their children. Dynamic trees (EAGLE-2) and
    vLLM's static ones."""
    checked = []

    def checking(head, cache, shape, state, logits, slots, base, key_starts, *rest):
        before = [t.clone() for t in cache.k + cache.v]
        tokens, parents, scores = real(head, cache, shape, state, logits, slots, base, key_starts, *rest)
        if len(checked) < 6:
            oracle = type(cache)(1, cache.num_slots, cache.max_len, cache.k[0].shape[1], cache.k[0].shape[3],
                                 cache.k[0].dtype, "cpu")
            for t, b in zip(oracle.k + oracle.v, before):
                t.copy_(b)
            for row in range(tokens.shape[0]):
                for node in range(tokens.shape[1]):
                    path, at = [], node
                    while at >= 0:
                        path.insert(0, int(tokens[row, at]))
                        assert parents[row, at] < at
                        at = int(parents[row, at])
                    want = _chain_scores(head, oracle, slots[row], base[row], key_starts[row], state[row],
                                         logits[row], path)
                    assert abs(want[-1] - float(scores[row, node])) < 1e-4, (row, node, path)
                    if parents[row, node] >= 0:
                        assert scores[row, parents[row, node]] >= scores[row, node]
            checked.append(tokens.shape[0])
        return tokens, parents, scores

    name = "draft_static_tree" if static else "draft_tree"
    real = getattr(proposer_module, name)
    monkeypatch.setattr(proposer_module, name, checking)
    keys = {"k": 9, "speculative_token_tree": STATIC_TREE} if static else {"k": 10, "tree_depth": 4, "tree_top_k": 3}
    llm = _llm(target, **keys)
    long_prompt = "def walk(tree):\n" + "".join(f"    visit(tree.child_{i})\n" for i in range(24)) + "    ret"
    llm.generate([long_prompt, *CODE_PROMPTS[:2]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert len(checked) == 6 and max(checked) == 3
    assert max(llm.engine.proposer.pending.context_start) > 0


@pytest.mark.slow
def test_tree_drafts_decode_what_plain_decoding_does_and_accept_more(target, greedy_reference):
    """Mixed batch (4 prompts through 3 slots): greedy ids equal plain decoding's for the chain, a whole tree
    of the same depth, a tree sized each step by the cost model (rows cut to their likeliest nodes, or
    to none) and a static tree; the whole tree accepts more per step than the chain."""
    lengths = greedy_acceptance_lengths(lambda **keys: _llm(target, **keys), [
        {"k": 5},
        {"k": 12, "tree_depth": 5, "tree_top_k": 3},
        {"k": 12, "tree_depth": 5, "tree_top_k": 3, "adaptive": True},
        {"num_speculative_tokens": 9, "speculative_token_tree": STATIC_TREE}], greedy_reference)
    assert lengths[1] > lengths[0] + 0.2


def test_tree_drafts_sample_what_plain_decoding_samples(target):
    assert_samples_as_plain(target, _llm(target, k=8, tree_depth=4, tree_top_k=2, adaptive=True))
