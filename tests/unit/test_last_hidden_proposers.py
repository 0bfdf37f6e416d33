"""Medusa and MLP speculator proposers: each row drafts from its own newest verified hidden state (rows in any
slot order, verify steps of several positions, decode steps of one) and, for the MLP speculator, from its
newest token; each row drafts no more than its limit."""

import pytest
import torch

from draftsmith.methods import resolve_method
from draftsmith.methods.medusa.head import MedusaHead
from draftsmith.methods.mlp_speculator.head import MLPSpeculatorHead
from draftsmith.models.head_configs import MedusaConfig, MLPSpeculatorConfig
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import Row


def _head(method, target):
    torch.manual_seed(8)
    if method == "medusa":
        head = MedusaHead(MedusaConfig(hidden_size=256, vocab_size=8192, num_heads=3, num_layers=1))
    else:
        head = MLPSpeculatorHead(MLPSpeculatorConfig(emb_dim=256, inner_dim=64, vocab_size=8192, n_predict=3))
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.2)
    return head.attach_target(target)


def _expected(method, head, hidden: torch.Tensor, token: int) -> list[int]:
    """The head's three greedy drafts from one row's hidden state (and newest token), computed directly."""
    with torch.no_grad():
        if method == "medusa":
            return head(hidden[None]).argmax(-1)[0].tolist()
        state, tokens = head.start(hidden[None]), torch.tensor([token])
        out = []
        for i in range(3):
            state, logits = head.stage(i, state, tokens)
            tokens = logits.argmax(-1)
            out.append(int(tokens))
        return out


@pytest.mark.parametrize("method", ["medusa", "mlp_speculator"])
def test_each_row_drafts_from_its_newest_hidden_state(method, target, tmp_path):
    head = _head(method, target)
    head.save_pretrained(tmp_path)
    config = parse_speculative_config({"method": method, "model": str(tmp_path), "num_speculative_tokens": 3})
    proposer = resolve_method(method).proposer_class()(config, target, 4, 128)
    rows = [Row("a", 3, [1, 2, 3], [11]), Row("b", 0, [4, 5], [12, 13]), Row("c", 2, [6], [14])]
    # a verify step: rows out of slot order, 3, 2 and 1 positions verified
    features = torch.randn(3, 3, 256)
    proposer.observe(rows, [2, 2, 0], [3, 2, 1], features)
    drafts = proposer.propose(rows, [3, 1, 0])
    newest = [features[0, 2], features[1, 1], features[2, 0]]
    for b, (row, limit) in enumerate(zip(rows, [3, 1, 0])):
        expected = _expected(method, head, newest[b], row.output_token_ids[-1])[:limit]
        assert drafts.tokens[b].tolist() == expected + [-1] * (3 - limit), row.request_id
    assert drafts.counts.tolist() == [3, 1, 0]
    # then a decode step of rows in consecutive slots: only theirs change
    decode_rows = [Row("b", 0, [4, 5], [12, 13, 15]), Row("d", 1, [7], [16])]
    step = torch.randn(2, 1, 256)
    proposer.observe(decode_rows, [3, 1], [1, 1], step)
    rows = [decode_rows[0], decode_rows[1], rows[0]]
    drafts = proposer.propose(rows, [3, 3, 2])
    for b, (row, hidden) in enumerate(zip(rows, [step[0, 0], step[1, 0], features[0, 2]])):
        limit = [3, 3, 2][b]
        expected = _expected(method, head, hidden, row.output_token_ids[-1])[:limit]
        assert drafts.tokens[b].tolist() == expected + [-1] * (3 - limit), row.request_id


@pytest.mark.parametrize("method", ["medusa", "mlp_speculator"])
def test_held_steps_kept_by_reference_draft_from_each_slots_newest(method, target, tmp_path):
    """Plain steps handed over by reference (`observe_later`) draft as if each had been observed: a row reads
    the newest held step it was in, a row absent from later steps its own last one, and a prefill observed
    after held steps (a new request in a slot) is not overwritten by them; past MAX_LATER kept steps the
    newest are copied in, and drafts are still the same."""
    from draftsmith.methods.last_hidden import MAX_LATER

    head = _head(method, target)
    head.save_pretrained(tmp_path)
    config = parse_speculative_config({"method": method, "model": str(tmp_path), "num_speculative_tokens": 3})
    make = resolve_method(method).proposer_class()
    lazy, eager = make(config, target, 4, 128), make(config, target, 4, 128)
    layer = head.feature_layers[0]
    a, b, c = Row("a", 0, [1], [11]), Row("b", 1, [2], [12]), Row("c", 3, [3], [13])
    steps = [([a, b, c], torch.randn(3, 1, 256)), ([a, c], torch.randn(2, 1, 256)), ([c], torch.randn(1, 1, 256))]
    for rows, hidden in steps:
        assert lazy.observe_later(rows, [0] * len(rows), {layer: hidden})
        eager.observe(rows, [0] * len(rows), [1] * len(rows), hidden)
    assert lazy._later  # nothing copied yet
    prefill = Row("d", 1, [4, 5], [14])  # a new request in b's slot, after the held steps
    prompt = torch.randn(1, 2, 256)
    for proposer in (lazy, eager):
        proposer.observe([prefill], [0], [2], prompt)
    rows = [a, prefill, c]
    assert lazy.propose(rows, [3, 3, 3]).tokens.tolist() == eager.propose(rows, [3, 3, 3]).tokens.tolist()
    expected = _expected(method, head, prompt[0, 1], prefill.output_token_ids[-1])
    assert lazy.propose(rows, [3, 3, 3]).tokens[1].tolist() == expected
    for _ in range(MAX_LATER + 3):
        hidden = torch.randn(2, 1, 256)
        assert lazy.observe_later([a, c], [0, 0], {layer: hidden})
        eager.observe([a, c], [0, 0], [1, 1], hidden)
    assert len(lazy._later) < MAX_LATER
    assert lazy.propose(rows, [3, 3, 3]).tokens.tolist() == eager.propose(rows, [3, 3, 3]).tokens.tolist()
