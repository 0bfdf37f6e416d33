"""Static draft trees (methods.token_tree) and tree verification (serve.speculation.tree_verify): parsing and its
errors, the accepted path against a walk of the tree, every node's logits against a plain forward of its own
path, the accepted path's K/V where a chain puts them, and a Medusa candidate tree served greedy-equal and
seeded-sample-equal to plain decoding in a mixed batch, through the Triton slot kernel too (on the GPU where
there is one)."""

import random

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods.token_tree import TokenTree
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.loader import load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.sampling import SamplingBatch
from draftsmith.serve.speculation.config import parse_speculative_config
from draftsmith.serve.speculation.tree_verify import accept_path, ancestors, block_parents, verify_tree
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    KERNEL_DEVICE,
    make_tiny_checkpoint,
    model_device,
    slot_kernel_or_skip,
    spec_config,
)

MEDUSA_HEAD = DEMO_MODEL.parent / "demo-code-7m-medusa"
# Medusa's shape of tree: wide at the first head, narrowing after; 9 nodes, 3 deep
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)]"


def test_trees_parse_as_vllm_spells_them():
    tree = TokenTree.parse("[(1, 0), (0,), (0, 0), (1,), (0, 0, 0)]")
    assert tree.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))  # by depth, then path: parents first
    assert tree.parents == (-1, -1, 0, 1, 2) and tree.depths == (1, 1, 2, 2, 3) and tree.ranks == (0, 1, 0, 0, 0)
    assert tree.top_k == 2 and tree.max_depth == 3 and TokenTree.chain(3).parents == (-1, 0, 1)


@pytest.mark.parametrize("spec,message", [
    ("[(0,), (0, 1, 0)]", r"path \(0, 1, 0\) has no parent \(0, 1\)"),
    ("[(0,), (0,)]", r"path \(0,\) appears twice"),
    ("[(0,), (-1,)]", "a non-empty tuple of ranks >= 0"),
    ("[]", "a non-empty list"),
    ("[(0,", "not a list of tuples"),
])
def test_bad_trees_are_one_line_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        TokenTree.parse(spec)


@pytest.mark.parametrize("extra,message", [
    ({"num_speculative_tokens": 4}, "has 9 nodes: num_speculative_tokens must equal that, not 4"),
    ({"draft_sample_method": "probabilistic"}, "draft_sample_method must be greedy"),
    ({"adaptive": True}, "cannot be combined with adaptive=true"),
    ({"speculative_token_tree": "[(0,), (2, 0)]", "num_speculative_tokens": 2}, "has no parent"),
])
def test_bad_tree_configs_are_one_clear_error(extra, message):
    config = {"method": "medusa", "model": str(MEDUSA_HEAD), "num_speculative_tokens": 9,
              "speculative_token_tree": TREE, **extra}
    with pytest.raises(DraftsmithError, match=message):
        parse_speculative_config(config)


def test_a_tree_config_verifies_whole_steps_and_a_too_deep_tree_is_refused(target):
    config = parse_speculative_config({"method": "medusa", "model": str(MEDUSA_HEAD), "num_speculative_tokens": 9,
                                       "speculative_token_tree": TREE})
    assert config.adaptive is False and config.token_tree().num_nodes == 9
    deep = {"method": "medusa", "model": str(MEDUSA_HEAD), "num_speculative_tokens": 4,
            "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]"}
    with pytest.raises(DraftsmithError, match="is 4 deep, but the medusa head .* drafts at most 3 tokens in a row"):
        LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, target=target, speculative_config=deep)


def _random_tree(rng: random.Random, nodes: int) -> list[int]:
    """Parents of a random tree in BFS-compatible order (every parent before its children)."""
    return [rng.randrange(-1, i) for i in range(nodes)]


def _walk(parents: list[int], ids: list[int], choice: list[int], count: int) -> list[int]:
    """The accepted path's block columns, by walking: from the root, go to the child holding the target's
    choice while there is one."""
    path, at = [0], -1
    while True:
        nxt = [i for i in range(count) if parents[i] == at and ids[i + 1] == choice[at + 1]]
        if not nxt:
            return path
        at = nxt[0]
        path.append(at + 1)


def test_accepted_path_is_the_walk_of_the_tree():
    """Random trees (siblings of distinct tokens, some padded), random target choices: accept_path keeps
    exactly the path a walk from the root follows, and the ancestor mask is the parent chain's closure."""
    rng = random.Random(0)
    for _ in range(200):
        rows, nodes = 3, rng.randrange(1, 12)
        parents = [_random_tree(rng, nodes) for _ in range(rows)]
        counts = [rng.randrange(0, nodes + 1) for _ in range(rows)]
        ids, choice = [], []
        for row in range(rows):
            tokens = [rng.randrange(3)]  # the root's token is never compared
            for i in range(nodes):  # distinct among siblings, drawn from a small vocabulary so matches happen
                taken = {tokens[j + 1] for j in range(i) if parents[row][j] == parents[row][i]}
                tokens.append(rng.choice([t for t in range(nodes + 3) if t not in taken]))
            ids.append(tokens)
            choice.append([rng.choice([rng.randrange(4), *tokens]) for _ in range(nodes + 1)])
        parents_t, counts_t = torch.tensor(parents), torch.tensor(counts)
        cols = block_parents(parents_t, counts_t)
        seen = ancestors(cols)
        for row in range(rows):
            for i in range(counts[row]):
                chain, at = {0, i + 1}, parents[row][i]
                while at >= 0:
                    chain.add(at + 1)
                    at = parents[row][at]
                assert set(seen[row, i + 1].nonzero()[:, 0].tolist()) == chain
        path, accepted = accept_path(torch.tensor(choice), torch.tensor(ids), cols, seen, counts_t)
        for row in range(rows):
            want = _walk(parents[row], ids[row], choice[row], counts[row])
            assert accepted[row] == len(want) - 1
            assert path[row, : len(want)].tolist() == want and (path[row, len(want):] == -1).all()


def _prefill(model, cache, slot, ids):
    batch = ForwardBatch.build([slot], [0], [len(ids)], cache, model.config.sliding_window, model_device(model))
    with torch.inference_mode():
        model(torch.tensor([ids], device=model_device(model)), cache=cache, batch=batch, compute_logits=False)


def _plain_logits(model, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([sequence], device=model_device(model))).logits[0]


@pytest.mark.parametrize("family,kernel", [("llama", False), ("mistral-window", False),
                                           pytest.param("llama", True, marks=pytest.mark.cuda)])
def test_every_node_scores_as_its_own_path_and_the_path_lands_where_a_chain_puts_it(tmp_path, family, kernel,
                                                                                     monkeypatch):
    """Two rows, each a prompt in its slot and a tree after it (the second verifies only a 4-node prefix of it).
    One tree forward gives every node the logits a plain forward of the prompt plus that node's path gives
    its last token (tree mask, depth positions; the window family checks the window on depth positions).
    verify_tree then accepts the path built from the target's own choices, off the first branch where it
    can be, and afterwards the cache holds at the path's positions the K/V a plain forward of prompt + path
    writes there. With `kernel`, attention runs the Triton slot kernel's tree mask (on KERNEL_DEVICE:
    the interpreter on CPU); without, PyTorch's on the CPU."""
    device = KERNEL_DEVICE if kernel else "cpu"
    if kernel:
        slot_kernel_or_skip()
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "triton" if kernel else "torch")
    make_tiny_checkpoint(family, tmp_path / family)
    model = load_target(tmp_path / family, dtype="float32", device=device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    # the window family's tiny config has a window shorter than the first prompt
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (21, 13)]
    slots, starts, q_lens = [2, 0], [len(p) - 1 for p in prompts], [7, 5]
    tree = TokenTree.parse("[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]")
    ids = torch.tensor([[p[-1], *torch.randint(vocab, (tree.num_nodes,), generator=gen).tolist()] for p in prompts],
                       device=device)
    # row 0 accepts (0,) then (0, 1) (node 3, block column 4: moved to start + 2); row 1 accepts (1,)
    first = [int(_plain_logits(model, p)[-1].argmax()) for p in prompts]
    ids[0, 1], ids[0, 3] = first[0], first[0] + 1 if first[0] + 1 < vocab else 0  # (0,0) is not the choice
    ids[0, 4] = int(_plain_logits(model, prompts[0] + [first[0]])[-1].argmax())
    ids[1, 2] = first[1]
    ids[1, 1] = first[1] - 1 if first[1] > 0 else 1

    from draftsmith.serve.speculation.tree_verify import tree_batch

    parents = tree.parent_tensor(2, device)
    cache = model.make_cache(3, 64)
    for slot, prompt in zip(slots, prompts):
        _prefill(model, cache, slot, prompt[:-1])
    seen = ancestors(block_parents(parents, torch.tensor(q_lens, device=device) - 1))
    batch, positions = tree_batch(slots, starts, q_lens, seen, cache, model.config.sliding_window, device)
    assert (batch.slot_rows is not None) == kernel
    with torch.inference_mode():
        scored = model(ids, positions=positions, cache=cache, batch=batch).logits
    for row, prompt in enumerate(prompts):
        for node in range(q_lens[row] - 1):
            path, at = [], node
            while at >= 0:
                path.insert(0, int(ids[row, at + 1]))
                at = tree.parents[at]
            torch.testing.assert_close(scored[row, node + 1], _plain_logits(model, prompt + path)[-1], rtol=1e-4,
                                       atol=1e-4)

    greedy = SamplingBatch.build([SamplingParams(temperature=0)] * 2, [torch.Generator()] * 2, device)
    out, tokens, counts = verify_tree(model, cache, ids, slots, starts, q_lens, parents, greedy, ())
    assert counts.tolist() == [3, 2]
    reference = model.make_cache(1, 64)
    for row, prompt in enumerate(prompts):
        accepted = tokens[row, : int(counts[row]) - 1].tolist()
        sequence = prompt + accepted
        want = _plain_logits(model, sequence)
        torch.testing.assert_close(out.logits[row, : len(accepted) + 1], want[len(prompt) - 1 :], rtol=1e-4, atol=1e-4)
        assert tokens[row, len(accepted)] == want[-1].argmax()  # the new token: the target's choice after the path
        _prefill(model, reference, 0, sequence)
        for got, expect in zip(cache.k + cache.v, reference.k + reference.v):
            torch.testing.assert_close(got[slots[row], :, : len(sequence)], expect[0, :, : len(sequence)],
                                       rtol=1e-4, atol=1e-5)


def _medusa(target, tree: bool, **kwargs):
    spec = spec_config("medusa", MEDUSA_HEAD, 3)
    if tree:
        spec = {"method": "medusa", "model": str(MEDUSA_HEAD), "num_speculative_tokens": 9,
                "speculative_token_tree": TREE}
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
               speculative_config=spec, **kwargs)


def test_medusa_tree_decodes_what_plain_decoding_does(target, greedy_reference):
    """A mixed batch (4 prompts through 3 slots, rows joining and leaving): greedy token ids equal plain
    decoding's, and the tree, which holds the top-1 chain, accepts more per step than that chain alone."""
    params = SamplingParams(temperature=0, max_tokens=32)
    lengths = []
    for tree in (False, True):
        llm = _medusa(target, tree)
        outputs = llm.generate(CODE_PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference
        lengths.append(llm.get_metrics()["mean_acceptance_length"])
    assert lengths[1] > lengths[0] > 1.0


def test_medusa_tree_samples_what_plain_decoding_samples(target):
    """Seeded sampling draws each token with the noise of its sequence position; the tree's node choices
    do the same at every depth: so a sampled request gives the same tokens with and without the tree
    (lossless, and reproducible), with drafts accepted."""
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=s) for s in range(len(CODE_PROMPTS))]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target)
    want = [o.outputs[0].token_ids for o in plain.generate(CODE_PROMPTS, params, use_tqdm=False)]
    llm = _medusa(target, True)
    assert [o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS, params, use_tqdm=False)] == want
    assert llm.get_metrics()["num_accepted_tokens"] > 0


CHI2_DF5_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def _chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
    observed = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * samples.numel()
    return float(((observed - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafts", ["close", "far"])
def test_tree_sampling_keeps_the_target_distribution(drafts):
    """20000 sampled verify steps of one tree over a 6-token vocabulary whose nodes hold the target's likeliest
    tokens (close) or its least likely (far): the first emitted token follows the root's distribution, and the
    second, after the depth-1 node that has children, follows that node's distribution (chi-square, p =
    0.001), as plain sampling would."""
    vocab, trials = 6, 20000
    gen = torch.Generator().manual_seed(3)
    # spread enough that the least likely tokens still come up some thousand times
    root = torch.randn(vocab, generator=gen) * 0.6
    child = {x: torch.randn(vocab, generator=gen) for x in range(vocab)}
    order = root.argsort(descending=drafts == "close")
    first = order[:3].tolist()  # depth 1: three candidates of the root
    branch = child[first[0]].argsort(descending=drafts == "close")[:2].tolist()  # depth 2 under the first
    tree = TokenTree.parse("[(0,), (1,), (2,), (0, 0), (0, 1)]")
    ids = torch.tensor([0, *first, *branch])[None].expand(trials, -1)
    # the depth-2 nodes' own distributions are not tested (their draws end the step): uniform
    logits = torch.stack([root, *[child[x] for x in first], torch.zeros(vocab), torch.zeros(vocab)])
    logits = logits[None].expand(trials, -1, -1).contiguous()
    sampling = SamplingBatch.build([SamplingParams(temperature=1.0)] * trials, [None] * trials, "cpu",
                                   seeds=list(range(trials)), positions=[0] * trials)
    cols = block_parents(tree.parent_tensor(trials, "cpu"), torch.full((trials,), tree.num_nodes))
    seen = ancestors(cols)
    from draftsmith.serve.speculation.tree_verify import tree_choices

    choice = tree_choices(logits, seen.sum(-1) - 1, sampling)
    path, accepted = accept_path(choice, ids, cols, seen, torch.full((trials,), tree.num_nodes))
    emitted_first = torch.where(accepted > 0, ids.gather(1, path[:, 1:2].clamp(min=0))[:, 0], choice[:, 0])
    assert _chi2(emitted_first, torch.softmax(root, -1)) < CHI2_DF5_P001
    after = (accepted > 0) & (emitted_first == first[0])
    second = torch.where(accepted[after] > 1, ids[after].gather(1, path[after][:, 2:3].clamp(min=0))[:, 0],
                         choice[after].gather(1, path[after][:, 1:2])[:, 0])
    assert after.sum() > 1000
    assert _chi2(second, torch.softmax(child[first[0]], -1)) < CHI2_DF5_P001


class _Cost:
    """A cost model whose verify forward costs `per_node` more per node a row verifies."""

    def __init__(self, per_node: float):
        self.per_node = per_node

    def forward(self, rows: int, query_len: float) -> float:
        return 1.0 + self.per_node * (query_len - 1)

    def host(self, rows: int, speculative: bool) -> float:
        return 0.0


def test_trees_are_sized_by_confidence_against_the_verify_cost():
    """Free verification keeps every node a row has; a verify dearer than any node's chance keeps none (a plain
    step); in between, the likeliest nodes while each still pays (here the first two, at 0.9 and 0.6 against a
    node's cost of 0.3 of a step)."""
    from draftsmith.methods.proposer_base import DraftBatch
    from draftsmith.serve.speculation.tree_verify import size_trees

    def drafts():
        confidence = torch.tensor([[0.9, 0.6, 0.2, 0.1], [0.9, 0.6, 0.0, 0.0]])
        return DraftBatch(torch.zeros(2, 4, dtype=torch.long), torch.tensor([4, 2]), None,
                          torch.tensor([[-1, 0, 1, 0], [-1, 0, -1, -1]]), confidence)

    free, dear, between = drafts(), drafts(), drafts()
    assert size_trees(free, 2, _Cost(0.0), 0.5) == 4 and free.counts.tolist() == [4, 2]
    assert size_trees(dear, 2, _Cost(5.0), 0.5) == 0 and dear.counts.tolist() == [0, 0]
    assert size_trees(between, 2, _Cost(0.3), 0.0) == 2 and between.counts.tolist() == [2, 2]
