"""What a verify step keeps, matched on the host (`verified_tokens` on CPU, drafts without a q) against the
tensor path (`verify`): the same accepted drafts and new token per row, greedy and sampled rows (seeded, so
both draw the same noise), rows drafting nothing, drafts that match the target's choices for a while."""

import pytest
import torch

from draftsmith.methods.proposer_base import DraftBatch
from draftsmith.serve.engine.sampling import SamplingBatch
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.speculation.rejection_reference import rejection_sample_reference
from draftsmith.serve.speculation.verify import verified_tokens, verify


def _batch(temperatures):
    params = [SamplingParams(temperature=t, seed=7 + i) for i, t in enumerate(temperatures)]
    return SamplingBatch.build(params, [torch.Generator().manual_seed(7 + i) for i in range(len(params))], "cpu",
                               seeds=[7 + i for i in range(len(params))], positions=[40 + i for i in range(len(params))])


def _tensor_path(logits, drafts, num_draft, sampling):
    tokens, counts = verify(logits, drafts, num_draft, sampling, rejection_sample_reference, None)
    return [row[:n] for row, n in zip(tokens.tolist(), counts.tolist())]


@pytest.mark.parametrize("temperatures", [[0.0] * 5, [0.0, 0.8, 0.0, 1.2, 0.5]])
@pytest.mark.parametrize("width", [1, 4])
def test_host_matching_keeps_what_the_tensor_path_keeps(temperatures, width):
    generator = torch.Generator().manual_seed(width)
    rows, vocab = len(temperatures), 50
    for trial in range(20):
        logits = 3 * torch.randn(rows, width + 1, vocab, generator=generator)
        counts = torch.randint(0, width + 1, (rows,), generator=generator)
        counts[0] = width  # the padded width is what some row drafted
        tokens = torch.randint(0, vocab, (rows, width), generator=generator)
        # drafts that agree with the target's argmax up to a random point, so that some are accepted
        agree = torch.randint(0, width + 1, (rows,), generator=generator)
        argmax = logits[:, :width].argmax(-1)
        tokens = torch.where(torch.arange(width)[None, :] < agree[:, None], argmax, tokens)
        tokens = torch.where(torch.arange(width)[None, :] < counts[:, None], tokens, -1)
        drafts = DraftBatch(tokens, counts)
        num_draft = counts.tolist()
        kept = verified_tokens(logits, drafts, num_draft, _batch(temperatures), rejection_sample_reference, None)
        assert kept == _tensor_path(logits, drafts, num_draft, _batch(temperatures)), trial
        listed = verified_tokens(logits, drafts, num_draft, _batch(temperatures), rejection_sample_reference,
                                 None, tokens.tolist())  # the drafts as the verify step lists them
        assert listed == kept, trial
        assert all(1 <= len(row) <= n + 1 for row, n in zip(kept, num_draft))
        if not any(temperatures):  # greedy: drafts kept while they are the argmax, then the argmax
            for row, n, a in zip(kept, num_draft, agree.tolist()):
                assert len(row) == min(n, a) + 1
