"""The fused greedy draft pick (Triton, on the GPU where there is one, else under the interpreter on CPU)
against its PyTorch reference, its device rules, and an EAGLE-3 engine picking its drafts through it: the
same drafts, greedy output equal to plain decoding."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods import draft_pick_triton as kernel
from draftsmith.methods.draft_pick_reference import greedy_pick_reference
from draftsmith.serve import LLM
from helpers import DEMO_MODEL, KERNEL_DEVICE, greedy_token_ids, spec_config, triton_kernel_marks

pytestmark = triton_kernel_marks(kernel)


@pytest.mark.cuda
@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 1024), (3, 2500), (8, 32000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_d2t", [False, True])
def test_kernel_matches_the_reference(rows, vocab, dtype, with_d2t):
    """Vocabularies under, at and across BLOCK_V chunks (the running max moving between chunks), peaked and
    flat rows, bf16 logits, with and without EAGLE-3's d2t offsets."""
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=generator) * torch.linspace(0.5, 8, rows)[:, None]
    logits = logits.to(dtype).to(KERNEL_DEVICE)
    d2t = torch.randint(0, 50, (vocab,), generator=generator).to(KERNEL_DEVICE) if with_d2t else None
    ids, probs = kernel.greedy_pick(logits, d2t)
    want_ids, want_probs = greedy_pick_reference(logits, d2t)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_ties_and_strided_rows():
    """The first index wins a tie, across chunks too (torch.max's choice), and rows of a wider tensor (a
    view, as a draft step's logits at its last query are) read right."""
    logits = torch.zeros(2, 3000, device=KERNEL_DEVICE)
    logits[0, [5, 2000]] = 3.0
    logits[1, [1500, 2999]] = 2.0
    wide = torch.randn(2, 2, 3000, device=KERNEL_DEVICE)
    wide[:, 1] = logits
    ids, probs = kernel.greedy_pick(wide[:, 1])
    assert ids.tolist() == [5, 1500]
    torch.testing.assert_close(probs, greedy_pick_reference(logits)[1])


@pytest.mark.slow
@pytest.mark.cuda
def test_eagle3_engine_drafts_through_the_kernel(monkeypatch, kernel_target, kernel_greedy_reference):
    """DRAFTSMITH_DRAFT_PICK=triton: every greedy draft step of the demo EAGLE-3 head (eager steps, on
    KERNEL_DEVICE) picks through the kernel (d2t applied in it); the drafts equal PyTorch's and the output is
    plain greedy decoding's."""
    calls = []
    real = kernel.greedy_pick
    monkeypatch.setattr(kernel, "greedy_pick", lambda *a: calls.append(a[0].shape) or real(*a))
    spec = spec_config("eagle3", DEMO_MODEL.parent / "demo-code-7m-eagle3", 4)

    def run():
        llm = LLM(DEMO_MODEL, dtype="float32", device=KERNEL_DEVICE, max_num_seqs=3, max_model_len=256,
                  target=kernel_target, enforce_eager=True, speculative_config=spec)
        return greedy_token_ids(llm), llm.get_metrics()

    monkeypatch.setenv("DRAFTSMITH_DRAFT_PICK", "triton")
    got, metrics = run()
    assert got == kernel_greedy_reference and len(calls) > 10
    monkeypatch.setenv("DRAFTSMITH_DRAFT_PICK", "torch")
    calls.clear()
    _, torch_metrics = run()
    assert not calls
    assert metrics["accepted_per_position"] == torch_metrics["accepted_per_position"]  # the same drafts


def test_kernel_tensors_are_on_cuda_or_under_the_interpreter(monkeypatch):
    """The kernel's device rules, each one line rather than a bad pointer inside Triton: its tensors share one
    device, and that is CUDA, or the CPU under Triton's interpreter alone."""
    logits = torch.randn(2, 64)
    with pytest.raises(DraftsmithError, match="greedy_pick: d2t is on meta but logits on"):
        kernel.greedy_pick(logits.to(KERNEL_DEVICE), torch.zeros(64, dtype=torch.long, device="meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DraftsmithError, match="greedy_pick: logits is on cpu: Triton kernels run on CUDA"):
        kernel.greedy_pick(logits)


def test_greedy_block_choice_keeps_each_rows_limit():
    """A parallel drafter's greedy block: each row's first `limit` argmaxes, written to its own output row, and
    -1 past its limit (what the verifier reads as no draft)."""
    from draftsmith.methods.draft_sampling import choose_block

    logits = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    tokens = torch.full((6, 8), -1)
    choose_block(logits, [5, 2, 0], torch.tensor([4, 0, 2]), None, {}, tokens, None)
    want = logits.argmax(-1)
    assert torch.equal(tokens[4, :5], want[0]) and torch.equal(tokens[0, :2], want[1, :2])
    assert (tokens[0, 2:] == -1).all() and (tokens[2] == -1).all() and (tokens[[1, 3, 5]] == -1).all()
