"""speculators 0.9 as the oracle for `draftsmith convert --to speculators` DFlash exports, in both block
layouts: its from_pretrained loads them with no key missing or left over, its forward computes the block
logits ours does, and the slots it trains with each verifier position's logits are the slots draftsmith
reads drafts from and trains the same way (`DFlashConfig.draft_slots`, `objective._block_targets`)."""

import pytest
import torch

import public_checkpoints as pub
import speculators_oracle as oracle
from draftsmith.methods import load_head
from draftsmith.methods.dflash.objective import _block_targets
from draftsmith.models import load_target
from helpers import DEMO_MODEL, random_dflash_head


@pytest.fixture(scope="module")
def target():
    return load_target(DEMO_MODEL, dtype="float32")


@pytest.mark.parametrize("anchor_first", [False, True])
def test_speculators_loads_our_dflash_export_and_computes_our_blocks(target, tmp_path, anchor_first):
    oracle.require()
    head = random_dflash_head(target, block_size=5, seed=6, sample_from_anchor=anchor_first)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "export", "--to", "speculators") == 0
    theirs, missing, unexpected = oracle.load(tmp_path / "export", dflash=True)
    assert (missing, unexpected) == ([], [])
    assert all(torch.isfinite(p).all() for p in theirs.parameters())  # speculators marks unloaded weights NaN
    assert theirs.config.sample_from_anchor is anchor_first

    ours = load_head(tmp_path / "native").attach_target(target)
    torch.manual_seed(0)
    ids, anchors = torch.randint(4, 8000, (1, 24)), torch.tensor([3, 9, 14])
    last_hidden = torch.randn(1, 24, target.config.hidden_size)  # a pre-norm last layer, as vLLM captures it
    with torch.no_grad():
        features = ours.features(target(ids, feature_layers=ours.feature_layers).hidden_states)
        blocks = ours.readout(ours.training_forward(features, ids, anchors[None])).view(3, 5, -1)
    logits, their_targets, trained = oracle.dflash_blocks(theirs, features, ids, anchors, last_hidden)
    torch.testing.assert_close(blocks, logits, atol=2e-5, rtol=0)

    slots = ours.config.draft_slots(ours.config.max_drafts())
    assert trained[:, slots].all() and trained.sum() == 3 * ours.config.max_drafts()  # only the draft slots learn
    with torch.no_grad():
        verifier = {"last": target.model.norm(last_hidden)}  # what draftsmith's features["last"] holds
        batch = {"input_ids": ids, "lengths": torch.tensor([24])}
        _, _, our_targets = _block_targets(target, batch, verifier, anchors[None], ours.config.max_drafts())
    torch.testing.assert_close(our_targets[0], their_targets[:, slots], atol=2e-5, rtol=0)
