"""Rejection sampler: Triton kernel == PyTorch reference (on the GPU where there is one), the kernel's device
rules, and the output distribution is the target's."""

import os

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.serve.speculation.rejection_reference import rejection_sample_reference
from helpers import KERNEL_DEVICE

# Both implementations compute identical fp32 expressions; the outputs are integer tokens, so exact.
triton_interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="set TRITON_INTERPRET=1 (the Makefile does) or run on a GPU")


def _case(rows, k, vocab, seed, with_q, greedy_rows=(), num_draft=None):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(rows, k + 1, vocab, generator=g) * 2).softmax(-1)
    argmax = p.argmax(-1)
    q = (torch.randn(rows, k, vocab, generator=g) * 2).softmax(-1) if with_q else None
    draft = torch.randint(0, vocab, (rows, k), generator=g)
    draft[:, : k // 2] = argmax[:, : k // 2]  # some drafts agree with the target so chains get long
    num_draft = torch.tensor(num_draft if num_draft is not None else [k] * rows)
    draft[torch.arange(k)[None] >= num_draft[:, None]] = -1
    uniforms = torch.rand(rows, k, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    greedy = torch.zeros(rows, dtype=torch.bool)
    greedy[list(greedy_rows)] = True
    return p, argmax, draft, num_draft, q, uniforms, noise, greedy


def _on(device, args: tuple) -> tuple:
    """A case's tensors moved to `device` (None, for no draft probabilities, stays None)."""
    return tuple(None if t is None else t.to(device) for t in args)


@pytest.mark.cuda
@triton_interpreted
@pytest.mark.parametrize("rows,k,vocab,with_q,synthetic", [
    (4, 3, 64, False, None),  # one-hot drafts (n-gram)
    (5, 4, 1500, True, None),  # vocab over one block with a non-power-of-2 tail
    (3, 5, 200, False, 0.6),  # synthetic acceptance
    (2, 1, 8192, True, None),  # the demo model's vocabulary
])
def test_triton_kernel_equals_reference(rows, k, vocab, with_q, synthetic):
    from draftsmith.serve.speculation.rejection_triton import rejection_sample_triton

    for seed in range(3):
        args = _on(KERNEL_DEVICE, _case(rows, k, vocab, seed, with_q, greedy_rows=[0],
                                        num_draft=[k, max(k - 1, 0)] + [k] * (rows - 2)))
        ref_out, ref_n = rejection_sample_reference(*args, synthetic_rate=synthetic)
        out, n = rejection_sample_triton(*args, synthetic_rate=synthetic)
        assert torch.equal(out, ref_out) and torch.equal(n, ref_n)


@triton_interpreted
def test_kernel_tensors_are_on_cuda_or_under_the_interpreter(monkeypatch):
    """The kernel's device rules, each one line rather than a bad pointer inside Triton: its tensors share one
    device, and that is CUDA, or the CPU under Triton's interpreter alone."""
    from draftsmith.serve.speculation.rejection_triton import rejection_sample_triton

    args = list(_on(KERNEL_DEVICE, _case(2, 3, 64, 0, with_q=True)))
    args[6] = args[6].to("meta")  # the noise elsewhere than the rest
    with pytest.raises(DraftsmithError, match="rejection_sample_triton: noise is on meta but target_probs on"):
        rejection_sample_triton(*args)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DraftsmithError, match="rejection_sample_triton: target_probs is on cpu: Triton kernels run"):
        rejection_sample_triton(*_case(2, 3, 64, 0, with_q=True))


def test_greedy_rows_accept_the_matching_prefix():
    p = torch.zeros(1, 4, 5)
    for pos, tok in enumerate([2, 4, 1, 3]):
        p[0, pos, tok] = 1.0
    args = (p, p.argmax(-1), torch.tensor([[2, 4, 0]]), torch.tensor([3]), None, torch.zeros(1, 3),
            torch.ones(1, 5), torch.tensor([True]))
    out, n = rejection_sample_reference(*args)
    assert out.tolist() == [[2, 4, 1, -1]] and n.tolist() == [3]  # 2, 4 accepted, 0 replaced by argmax 1
    all_ok = (p, p.argmax(-1), torch.tensor([[2, 4, 1]]), torch.tensor([3]), None, torch.zeros(1, 3),
              torch.ones(1, 5), torch.tensor([True]))
    assert rejection_sample_reference(*all_ok)[0].tolist() == [[2, 4, 1, 3]]  # bonus token appended


@pytest.mark.parametrize("q_kind", ["one_hot_likely", "one_hot_unlikely", "close", "far"])
def test_first_emitted_token_follows_the_target_distribution(q_kind):
    """Over many trials the token emitted at position 0 (accepted draft or recovered) is distributed as p_0."""
    vocab, trials = 6, 40000
    g = torch.Generator().manual_seed(1)
    p0 = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    p = torch.stack([p0, torch.full((vocab,), 1 / vocab)])[None].expand(trials, 2, vocab)
    if q_kind.startswith("one_hot"):
        token = 0 if q_kind == "one_hot_likely" else 5
        draft, q = torch.full((trials, 1), token), None
    else:
        base = p0 + 0.02 * torch.randn(vocab, generator=g) if q_kind == "close" else torch.tensor(
            [0.02, 0.03, 0.05, 0.1, 0.3, 0.5])
        q_row = base.clamp(min=1e-3) / base.clamp(min=1e-3).sum()
        q = q_row[None, None].expand(trials, 1, vocab).contiguous()
        draft = torch.multinomial(q_row, trials, replacement=True, generator=g)[:, None]
    out, _ = rejection_sample_reference(
        p.contiguous(), p.argmax(-1), draft, torch.ones(trials, dtype=torch.long), q,
        torch.rand(trials, 1, generator=g), torch.empty(trials, vocab).exponential_(generator=g),
        torch.zeros(trials, dtype=torch.bool))
    freq = torch.bincount(out[:, 0], minlength=vocab).float() / trials
    tv = 0.5 * (freq - p0).abs().sum().item()
    assert tv < 0.015, (q_kind, freq, tv)  # sampling noise alone gives TV ~ 0.005 at 40k trials
    if q_kind == "far":  # a wrong sampler (e.g. always accept) would give q instead
        assert 0.5 * (freq - q_row).abs().sum().item() > 0.3
