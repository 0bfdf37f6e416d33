"""speculators 0.9 as the independent oracle of DSpark's layout (vLLM's CPU build refuses the method, so this
is the implementation besides draftsmith's that runs a DSpark head here): its from_pretrained loads our
`--to speculators` export with no key missing or left over, its training forward computes the block logits
ours does with the Markov bias of each position's previous token (anchor-first: the anchor for position 0)
and the confidence logits ours does, and a checkpoint its save_pretrained writes converts in and computes
the same. A slip in the anchor-first convention moves every Markov bias one token and fails here."""

import pytest
import torch

import public_checkpoints as pub
import speculators_oracle as oracle
from draftsmith.methods import load_head
from draftsmith.methods.dspark.objective import block_outputs
from draftsmith.models import load_target
from helpers import DEMO_MODEL, random_dflash_head


@pytest.fixture(scope="module")
def target():
    return load_target(DEMO_MODEL, dtype="float32")


def _ours(directory, target, ids, anchors, last_hidden):
    """draftsmith's teacher-forced DSpark blocks from `anchors`: (logits with the Markov term [A, n, V],
    confidence logits [A, n])."""
    head = load_head(directory).attach_target(target).eval()
    drafts = head.config.max_drafts()
    with torch.no_grad():
        features = {"features": head.features(target(ids, feature_layers=head.feature_layers).hidden_states),
                    "last": target.model.norm(last_hidden)}
        batch = {"input_ids": ids, "lengths": torch.tensor([ids.shape[1]])}
        logits, hidden, embedded, *_ = block_outputs(head, target, batch, features, anchors[None], drafts)
        confidence = head.confidence_logits(hidden, embedded)
    return features["features"], logits[0], confidence[0]


def _inputs(target):
    torch.manual_seed(0)
    ids, anchors = torch.randint(4, 8000, (1, 24)), torch.tensor([3, 9, 14])
    return ids, anchors, torch.randn(1, 24, target.config.hidden_size)


def _markov_heavy_export(target, directory, markov_head_type):
    """A random DSpark head (block 5, rank 16) whose Markov term moves the drafts, saved and exported."""
    head = random_dflash_head(target, block_size=5, seed=7, dspark={"markov_rank": 16,
                                                                    "markov_head_type": markov_head_type})
    with torch.no_grad():
        head.markov_head.markov_w1.weight.normal_(std=1.0)
        head.markov_head.markov_w2.weight.normal_(std=1.0)
        if head.markov_head.gated:  # gates far from a constant: a gate read from another input fails
            head.markov_head.gate_proj.weight.normal_(std=0.1)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(directory / "native")
    assert pub.convert(directory / "native", directory / "export", "--to", "speculators") == 0


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated"])
def test_speculators_loads_our_dspark_export_and_computes_our_blocks(target, tmp_path, markov_head_type):
    oracle.require()
    _markov_heavy_export(target, tmp_path, markov_head_type)
    theirs, missing, unexpected = oracle.load(tmp_path / "export", dspark=True)
    assert (missing, unexpected) == ([], [])
    assert all(torch.isfinite(p).all() for p in theirs.parameters())  # speculators marks unloaded weights NaN
    assert theirs.config.sample_from_anchor is True and theirs.config.markov_rank == 16
    assert theirs.config.markov_head_type == markov_head_type

    ids, anchors, last_hidden = _inputs(target)
    features, logits, confidence = _ours(tmp_path / "native", target, ids, anchors, last_hidden)
    their_logits, their_confidence = oracle.dspark_blocks(theirs, features, ids, anchors, last_hidden)
    torch.testing.assert_close(logits, their_logits, atol=5e-5, rtol=0)
    torch.testing.assert_close(confidence, their_confidence, atol=2e-5, rtol=0)
    with torch.no_grad():  # the Markov term matters here: without it the blocks are others
        theirs.markov_head.markov_w2.weight.zero_()
    bare, _ = oracle.dspark_blocks(theirs, features, ids, anchors, last_hidden)
    assert (bare.argmax(-1) != logits.argmax(-1)).float().mean() > 0.2


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated"])
def test_a_checkpoint_speculators_saves_converts_in_and_computes_its_blocks(target, tmp_path, markov_head_type):
    oracle.require()
    _markov_heavy_export(target, tmp_path, markov_head_type)
    theirs, _, _ = oracle.load(tmp_path / "export", dspark=True)
    with torch.no_grad():  # weights of their own, so nothing of ours survives but through the files
        generator = torch.Generator().manual_seed(11)
        for name, param in theirs.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_", "lm_head")):
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    assert pub.convert(tmp_path / "theirs", tmp_path / "back", "--target", str(DEMO_MODEL)) == 0

    ids, anchors, last_hidden = _inputs(target)
    features, logits, confidence = _ours(tmp_path / "back", target, ids, anchors, last_hidden)
    their_logits, their_confidence = oracle.dspark_blocks(theirs, features, ids, anchors, last_hidden)
    torch.testing.assert_close(logits, their_logits, atol=5e-5, rtol=0)
    torch.testing.assert_close(confidence, their_confidence, atol=2e-5, rtol=0)
