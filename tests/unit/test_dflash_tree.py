"""Draft trees from one DFlash block (methods.draft_trees): the dynamic tree keeps the likeliest paths of the
block's per-depth distributions with their parents, static trees read the ranks they name, and served trees
from the shipped head decode greedily and sample (seeded) exactly what plain decoding does, accepting more
per step than the block's chain."""

import itertools

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_trees import TreeShape, marginal_tree, static_marginal_tree
from draftsmith.methods.token_tree import TokenTree
from draftsmith.serve import LLM
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import (
    DEMO_MODEL,
    REPO,
    assert_samples_as_plain,
    greedy_acceptance_lengths,
    recorded_draft_forwards,
    spec_config,
)

SHIPPED = REPO / "assets" / "demo-code-7m-dflash"
STATIC_TREE = "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]"


def _paths(tokens, parents, row):
    """Each node's path of tokens from the root, checking that parents come before their children."""
    paths = []
    for node in range(tokens.shape[1]):
        parent = int(parents[row, node])
        assert parent < node
        paths.append((paths[parent] if parent >= 0 else ()) + (int(tokens[row, node]),))
    return paths


def test_a_two_deep_tree_is_the_likeliest_paths_of_the_block():
    """Two depths expanding every depth-1 node: the tree is exactly the `total` likeliest of all 1- and
    2-token paths over each depth's top-k (scores: sums of log-probabilities), likeliest first."""
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 40) * 3
    shape = TreeShape(depth=2, top_k=4, total=9)
    tokens, parents, scores = marginal_tree(logits, shape)
    log_probs = logits.log_softmax(-1)
    for row in range(3):
        top = [log_probs[row, d].topk(4).indices.tolist() for d in range(2)]
        every = {(a,): float(log_probs[row, 0, a]) for a in top[0]}
        every.update({(a, b): float(log_probs[row, 0, a] + log_probs[row, 1, b])
                      for a, b in itertools.product(top[0], top[1])})
        want = sorted(every, key=lambda p: -every[p])[:9]
        got = _paths(tokens, parents, row)
        assert got == want
        torch.testing.assert_close(scores[row], torch.tensor([every[p] for p in want]), atol=1e-5, rtol=0)


def test_a_deep_tree_expands_the_likeliest_nodes_and_keeps_parents():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 30) * 2
    tokens, parents, scores = marginal_tree(logits, TreeShape(depth=5, top_k=3, total=14))
    log_probs = logits.log_softmax(-1)
    for row in range(2):
        for node, path in enumerate(_paths(tokens, parents, row)):
            want = sum(float(log_probs[row, d, t]) for d, t in enumerate(path))
            assert abs(want - float(scores[row, node])) < 1e-4
            if parents[row, node] >= 0:
                assert scores[row, parents[row, node]] >= scores[row, node]
        assert len(set(_paths(tokens, parents, row))) == 14
    assert bool((scores[:, :-1] >= scores[:, 1:] - 1e-3).all())  # likeliest first (up to the depth penalty)


def test_a_static_tree_holds_the_ranks_it_names():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 50)
    tree = TokenTree.parse(STATIC_TREE)
    tokens = static_marginal_tree(logits, tree)
    ranked = logits.argsort(-1, descending=True)
    for node, path in enumerate(tree.paths):
        assert torch.equal(tokens[:, node], ranked[:, len(path) - 1, path[-1]])
    assert torch.equal(static_marginal_tree(logits, tree, 5), tokens[:, :5])


def _spec(**keys):
    return spec_config("dflash", SHIPPED, draft_dtype="float32", **keys)


def _llm(target, **keys):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
               speculative_config=_spec(**keys))


def test_bad_tree_keys_are_one_line(target):
    with pytest.raises(DraftsmithError, match=r"tree_depth=9, but the dflash head .* drafts at most 8 tokens in a row"):
        _llm(target, num_speculative_tokens=16, tree_depth=9, tree_top_k=2)
    with pytest.raises(DraftsmithError, match="must be greedy"):
        parse_speculative_config(_spec(num_speculative_tokens=8, tree_depth=4, tree_top_k=2,
                                       draft_sample_method="probabilistic"))
    with pytest.raises(DraftsmithError, match="has 10 candidates: num_speculative_tokens=12"):
        parse_speculative_config(_spec(num_speculative_tokens=12, tree_depth=3, tree_top_k=2))


@pytest.mark.slow
def test_block_trees_decode_what_plain_decoding_does_and_accept_more(target, greedy_reference):
    """Mixed batch (4 prompts through 3 slots): greedy ids equal plain decoding's
    for the block's chain, a whole dynamic tree, one sized each step by the cost model and a static tree; the
    whole dynamic tree accepts more per step than the chain."""
    lengths = greedy_acceptance_lengths(lambda **keys: _llm(target, **keys), [
        {"k": 8},
        {"k": 16, "tree_depth": 8, "tree_top_k": 3},
        {"k": 16, "tree_depth": 8, "tree_top_k": 3, "adaptive": True},
        {"num_speculative_tokens": 8, "speculative_token_tree": STATIC_TREE}], greedy_reference)
    assert lengths[1] > lengths[0] + 0.2


def test_block_trees_sample_what_plain_decoding_samples(target):
    llm = _llm(target, k=12, tree_depth=6, tree_top_k=2)
    forwards = recorded_draft_forwards(llm)
    assert_samples_as_plain(target, llm)
    assert max(forwards) == 1  # the whole tree from one block forward
