import pytest
import torch

from draftsmith.methods.ngram.proposer import NgramProposer, find_continuations
from draftsmith.serve.engine.request import Request
from draftsmith.serve.engine.sampling_params import SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config


def _starts(histories, min_n, max_n):
    width = max(map(len, histories))
    tokens = torch.zeros(len(histories), width, dtype=torch.long)
    for i, h in enumerate(histories):
        tokens[i, : len(h)] = torch.tensor(h)
    return find_continuations(tokens, torch.tensor([len(h) for h in histories]), min_n, max_n).tolist()


def test_vllm_docstring_example_and_tie_rules():
    # [1,2,3,4,2,3], min 2, max 3: the 3-gram [4,2,3] has no earlier match, the 2-gram [2,3] does at 1
    assert _starts([[1, 2, 3, 4, 2, 3]], 2, 3) == [3]
    # the longest n wins even if a shorter one matches earlier
    assert _starts([[7, 3, 9, 1, 2, 3, 8, 1, 2, 3]], 1, 3) == [6]
    # among equal n, the most recent occurrence wins (vLLM: the earliest, here 2)
    assert _starts([[5, 6, 1, 5, 6, 2, 5, 6]], 2, 2) == [5]
    # the most recent one may overlap the suffix itself: a run continues
    assert _starts([[3, 4, 5, 4, 5, 4, 5]], 2, 2) == [5]
    # no match, or history too short: -1; rows in one batch are independent
    assert _starts([[1, 2, 3, 4], [9, 9], [4, 5, 4, 5, 4]], 2, 2) == [-1, -1, 3]


def _request(rid, tokens, slot):
    r = Request(str(rid), tokens, SamplingParams(), torch.Generator())
    r.slot = slot
    return r


def test_proposer_drafts_follow_the_match_and_respect_limits():
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                      "prompt_lookup_max": 3})
    proposer = NgramProposer(config, None, max_num_seqs=3, max_model_len=32)
    a = _request(0, [1, 2, 3, 4, 5, 6, 1, 2], slot=2)
    b = _request(1, [9, 8, 7], slot=0)
    drafts = proposer.propose([a, b], [4, 4])
    assert _rows(drafts) == [[3, 4, 5, 6], []] and drafts.probs is None
    assert drafts.tokens[1].tolist() == [-1] * 4  # padding past the count
    a.output_token_ids += [3, 4]  # history now ...1 2 3 4: the 3-gram [2,3,4] matched at 1
    assert _rows(proposer.propose([a], [2])) == [[5, 6]]
    # a new request reusing the slot starts from a clean history
    c = _request(2, [4, 4, 4], slot=2)
    assert _rows(proposer.propose([c], [4])) == [[4]]  # [4,4] matched at 0, one token follows


def _rows(drafts):
    """A DraftBatch as per-row lists, checking its -1 padding on the way."""
    rows = []
    for tokens, count in zip(drafts.tokens.tolist(), drafts.counts.tolist()):
        assert all(t == -1 for t in tokens[count:])
        rows.append(tokens[:count])
    return rows


def _reference(history, min_n, max_n):
    """Prompt lookup written out: the longest suffix n-gram with an earlier occurrence followed by a token,
    its most recent occurrence; where the proposal starts, or -1."""
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if length <= n:
            continue
        suffix = history[length - n :]
        for start in reversed(range(0, length - n)):
            if history[start : start + n] == suffix:
                return start + n
    return -1


def test_matches_a_written_out_lookup_on_random_histories():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        rows = int(torch.randint(1, 6, (1,), generator=generator))
        vocab = int(torch.randint(2, 6, (1,), generator=generator))  # small vocabularies repeat n-grams
        histories = [torch.randint(0, vocab, (int(torch.randint(1, 30, (1,), generator=generator)),),
                                   generator=generator).tolist() for _ in range(rows)]
        min_n = int(torch.randint(1, 4, (1,), generator=generator))
        max_n = min_n + int(torch.randint(0, 3, (1,), generator=generator))
        assert _starts(histories, min_n, max_n) == [_reference(h, min_n, max_n) for h in histories], (
            trial, histories, min_n, max_n)


def _use_ops(ops: str, monkeypatch) -> None:
    """The lookup by PyTorch's ops ("torch") or by the C++ op ("cpp", skipped where it did not build)."""
    from draftsmith.models import slot_attention_cpu

    if ops == "cpp" and slot_attention_cpu.build_error() is not None:
        pytest.skip(f"the CPU kernels did not build: {slot_attention_cpu.build_error()}")
    monkeypatch.setattr(slot_attention_cpu, "LOADED", ops == "cpp")


def _random_proposer(generator, k: int, slots: int, max_model_len: int):
    """A proposer with a random lookup window (min_n 1-3, max_n up to 2 more) -> (it, min_n, max_n)."""
    min_n = int(torch.randint(1, 4, (1,), generator=generator))
    max_n = min_n + int(torch.randint(0, 3, (1,), generator=generator))
    config = parse_speculative_config({"method": "ngram", "num_speculative_tokens": k,
                                       "prompt_lookup_min": min_n, "prompt_lookup_max": max_n})
    return NgramProposer(config, None, max_num_seqs=slots, max_model_len=max_model_len), min_n, max_n


@pytest.mark.parametrize("ops", ["torch", "cpp"])
def test_proposer_drafts_what_the_written_out_lookup_finds(ops, monkeypatch):
    """The proposer's drafts, by PyTorch's ops or the C++ op (models/ngram_lookup_cpu.cpp), on random histories
    of rows in any slot order: the written-out lookup's continuation, up to each row's limit, k and the
    history's end."""
    _use_ops(ops, monkeypatch)
    generator = torch.Generator().manual_seed(1)
    for trial in range(100):
        proposer, min_n, max_n = _random_proposer(generator, 4, 6, 40)
        slots = torch.randperm(6, generator=generator)[: int(torch.randint(1, 7, (1,), generator=generator))]
        vocab = int(torch.randint(2, 6, (1,), generator=generator))
        rows = [_request(i, torch.randint(0, vocab, (int(torch.randint(1, 36, (1,), generator=generator)),),
                                          generator=generator).tolist(), int(slot)) for i, slot in enumerate(slots)]
        limits = torch.randint(0, 6, (len(rows),), generator=generator).tolist()
        expected = []
        for row, limit in zip(rows, limits):
            history = row.all_token_ids()
            start = _reference(history, min_n, max_n)
            expected.append([] if start < 0 else history[start : start + min(limit, 4)])
        assert _rows(proposer.propose(rows, limits)) == expected, (trial, ops)


def _reference_match_length(history, start, cap):
    """Tokens before `start` equal to the history's last ones, newest first, up to cap; 0 without a match."""
    if start < 0:
        return 0
    length = 0
    while length < cap and start - 1 - length >= 0 and history[start - 1 - length] == history[-1 - length]:
        length += 1
    return length


@pytest.mark.parametrize("ops", ["torch", "cpp"])
def test_match_lengths_are_the_written_out_run_before_the_proposal(ops, monkeypatch):
    """`NgramProposer.agreed`, by either implementation: how far the matched occurrence agrees with the
    history's end, at least the n that matched and at most max(AGREE_CAP, prompt_lookup_max); 0 where nothing
    matched."""
    from draftsmith.methods.ngram.calibration import AGREE_CAP

    _use_ops(ops, monkeypatch)
    generator = torch.Generator().manual_seed(2)
    seen = set()
    for trial in range(100):
        proposer, min_n, max_n = _random_proposer(generator, 3, 4, 80)
        vocab = int(torch.randint(2, 4, (1,), generator=generator))
        unit = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=generator)),), generator=generator)
        # a repeated unit and some noise: runs longer and shorter than the cap
        histories = [(unit.repeat(int(torch.randint(1, 8, (1,), generator=generator))).tolist()
                      + torch.randint(0, vocab, (int(torch.randint(0, 4, (1,), generator=generator)),),
                                      generator=generator).tolist())[:70] for _ in range(3)]
        rows = [_request(i, h, slot) for i, (h, slot) in enumerate(zip(histories, [3, 0, 2]))]
        proposer.propose(rows, [3] * len(rows))
        expected = [_reference_match_length(h, _reference(h, min_n, max_n), max(AGREE_CAP, max_n))
                    for h in histories]
        assert proposer.agreed[: len(rows)].tolist() == expected, (trial, ops, histories, min_n, max_n)
        seen.update(expected)
    assert 0 in seen and AGREE_CAP in seen and any(0 < n < AGREE_CAP for n in seen)
