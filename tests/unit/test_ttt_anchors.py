"""Training-time test at anchors: steps after the first run at some positions only (`training.num_anchors`).
A position's later steps see step 0's keys and their own, never another position's, so the anchored unroll
gives at each anchor exactly the full unroll's logits there, for every head the unroll drives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftsmith.methods import resolve_method
from draftsmith.methods.eagle.training import at_rows, sample_anchors, unroll
from draftsmith.methods.eagle3.objective import eagle3_objective
from draftsmith.models import DraftHeadConfig
from draftsmith.train.objectives import target_features

HEADS = {
    "eagle": ("eagle", (6,), {}),
    "eagle3": ("eagle3", (1, 3, 5), {}),
    "eagle3 two layers, window 5": ("eagle3", (1, 3, 5), {"num_hidden_layers": 2, "sliding_window": 5}),
    "P-EAGLE two layers": ("eagle3", (1, 3, 5), {"num_hidden_layers": 2, "parallel_drafting": True,
                                                 "ptd_token_id": 3}),
}


def _head(target, name):
    kind, layers, extra = HEADS[name]
    config = DraftHeadConfig.for_target(kind, target.config, layers, None, "demo", **extra)
    torch.manual_seed(0)
    head = resolve_method(kind).head_module(config).attach_target(target)
    with torch.no_grad():
        for param_name, param in head.named_parameters():
            torch.nn.init.normal_(param, mean=1.0 if param_name.endswith("norm.weight") else 0.0, std=0.1)
    return head.eval()


@pytest.mark.parametrize("name", HEADS)
def test_anchored_steps_equal_the_full_unroll_at_the_anchors(target, name):
    head = _head(target, name)
    ids = torch.randint(4, 8000, (2, 24))
    feats = target_features(target, head.feature_layers, ids, "float32")["features"]
    anchors = torch.tensor([[0, 5, 6, 17], [2, 3, 11, 20]])
    with torch.no_grad():
        full = [logits for _, logits in unroll(head, ids, feats, 4)]
        anchored = [logits for _, logits in unroll(head, ids, feats, 4, anchors)]
    torch.testing.assert_close(anchored[0], full[0])
    for step in range(1, 4):
        assert anchored[step].shape[1] == 4
        torch.testing.assert_close(anchored[step], at_rows(full[step], anchors), atol=1e-5, rtol=1e-4)


def test_anchors_are_drawn_where_the_mask_is_set():
    mask = torch.zeros(3, 40)
    mask[0, 10:30] = 1
    mask[1, :] = 1
    mask[2, 35:] = 1  # 5 set: the other 3 anchors fall where the loss is off
    generator = torch.Generator().manual_seed(0)
    draws = [sample_anchors(mask, 8, generator) for _ in range(200)]
    for anchors in draws:
        assert anchors.shape == (3, 8)
        assert (anchors.diff(dim=1) > 0).all()
        assert ((anchors[0] >= 10) & (anchors[0] < 30)).all()
        assert set(range(35, 40)) <= set(anchors[2].tolist())
    counts = torch.bincount(torch.cat([a[0] for a in draws]), minlength=40)[10:30].float()
    assert counts.min() > 0.6 * counts.mean()  # uniform over the set positions: 80 expected each


def test_objective_with_every_position_as_anchor_is_the_full_objective(target):
    head = _head(target, "P-EAGLE two layers")
    ids = torch.randint(4, 8000, (2, 24))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :6] = 0
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    feats = target_features(target, head.feature_layers, ids, "float32")
    cfg = SimpleNamespace(ttt_length=4, ttt_step_decay=0.5, num_anchors=None)
    full, full_logs = eagle3_objective(head, target, batch, feats, cfg)
    anchored, logs = eagle3_objective(head, target, batch, feats, SimpleNamespace(**{**vars(cfg), "num_anchors": 23}))
    torch.testing.assert_close(anchored, full)
    assert logs == pytest.approx(full_logs, rel=1e-5)
    fewer, _ = eagle3_objective(head, target, batch, feats, SimpleNamespace(**{**vars(cfg), "num_anchors": 5}))
    assert fewer.item() != pytest.approx(full.item(), rel=1e-4)  # fewer anchors: another sample of the loss
