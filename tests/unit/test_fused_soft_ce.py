"""The fused distillation loss (`methods.fused_soft_ce`) against the unfused formula autograd differentiates:
the same loss, argmaxes and gradients for the head's states, the Markov embeddings and the Markov weight, in
fp32 and under CPU autocast, with rows of zero weight and a chunk left over."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.methods import fused_soft_ce as fused

V, H, R = 512, 32, 8


def _inputs(rows: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    draw = lambda *shape, scale=1.0: torch.randn(*shape, generator=generator) * scale  # noqa: E731
    weights = torch.rand(rows, generator=generator)
    weights[::5] = 0  # positions the loss does not train
    return {"hidden": draw(rows, H).requires_grad_(), "teacher": draw(rows, H), "lm_head": draw(V, H, scale=0.3),
            "markov": draw(rows, R).requires_grad_(), "markov_weight": draw(V, R, scale=0.3).requires_grad_(),
            "row_weights": weights / weights.sum()}


def _unfused(x, kd, ce, markov: bool):
    logits = F.linear(x["hidden"], x["lm_head"]).float()
    if markov:
        logits = logits + F.linear(x["markov"], x["markov_weight"]).float()
    teacher = F.linear(x["teacher"], x["lm_head"]).float()
    log_q = torch.log_softmax(logits, -1)
    greedy = teacher.argmax(-1)
    per_row = -kd * (torch.softmax(teacher, -1) * log_q).sum(-1) - ce * log_q.gather(-1, greedy[:, None])[:, 0]
    return (per_row * x["row_weights"]).sum(), logits.argmax(-1), greedy


def _gradients(loss, x, markov: bool):
    names = ["hidden", "markov", "markov_weight"] if markov else ["hidden"]
    return dict(zip(names, torch.autograd.grad(loss, [x[n] for n in names]), strict=True))


@pytest.mark.parametrize("kd, ce, markov", [(1.0, 0.0, False), (1.0, 0.0, True), (0.5, 0.1, True), (0.0, 1.0, True)])
def test_fused_equals_the_unfused_loss_and_gradients_in_fp32(monkeypatch, kd, ce, markov):
    monkeypatch.setattr(fused, "CHUNK_ROWS", 16)  # 4 chunks and a part one
    x = _inputs(rows=70)
    loss, drafted, greedy = _unfused(x, kd, ce, markov)
    extra = {"markov": x["markov"], "markov_weight": x["markov_weight"]} if markov else {}
    got, got_drafted, got_greedy = fused.fused_soft_ce(x["hidden"], x["teacher"], x["lm_head"], x["row_weights"],
                                                       kd=kd, ce=ce, **extra)
    torch.testing.assert_close(got, loss, atol=1e-6, rtol=1e-6)
    assert torch.equal(got_drafted, drafted) and torch.equal(got_greedy, greedy)
    expected, grads = _gradients(loss, x, markov), _gradients(got, x, markov)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)
    assert grads["hidden"][::5].abs().max() == 0  # a row of weight 0 learns nothing


def test_under_cpu_autocast_the_gemms_run_in_bf16_as_the_unfused_ones_do():
    x = _inputs(rows=40, seed=1)
    x["hidden"] = x["hidden"].detach().view(2, 20, H).requires_grad_()  # leading dims are kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, drafted, _ = fused.fused_soft_ce(x["hidden"], x["teacher"].view(2, 20, H), x["lm_head"],
                                               x["row_weights"].view(2, 20), markov=x["markov"],
                                               markov_weight=x["markov_weight"])
        flat = {**x, "hidden": x["hidden"].view(40, H)}
        reference, _, _ = _unfused(flat, 1.0, 0.0, True)
    assert drafted.shape == (2, 20)
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    ours = torch.autograd.grad(loss, x["hidden"])[0]
    theirs = torch.autograd.grad(reference, x["hidden"])[0]
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, atol=2e-2 * theirs.abs().max().item(), rtol=0)


def test_a_trainable_lm_head_is_refused():
    x = _inputs(rows=4)
    with pytest.raises(ValueError, match="frozen"):
        fused.fused_soft_ce(x["hidden"], x["teacher"], x["lm_head"].requires_grad_(), x["row_weights"])
