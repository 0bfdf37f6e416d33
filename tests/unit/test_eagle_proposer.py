"""The batched EAGLE-3 proposer against a per-row reference on a tiny random target and head.

The reference is the straightforward algorithm: for one row, a fresh cache, the head over every verified
position at once, then one draft at a time. The proposer instead keeps pending features per slot (at most W,
the head's context then starting at the oldest one kept), catches up incrementally and drafts all rows at a
fixed width, so any bookkeeping slip (wrong pairing of feature and token, a lost or leaked pending position,
a context start off by one, a row's output taken past its limit) changes some row's drafts.
"""

from __future__ import annotations

import pytest
import torch

from draftsmith.methods import resolve_method
from draftsmith.methods.eagle import pending as pending_module
from draftsmith.models import DraftHeadConfig, ForwardBatch, load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.engine.sampling import SamplingBatch
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import DEMO_MODEL, REPO, Row, make_tiny_checkpoint, spec_config

K = 4
MAX_LEN = 96
# Probabilities of one draft and of the whole chain are compared after different batching (incremental
# catch-up vs one pass): only float rounding differs.
PROB_ATOL = 1e-5
SEED = 100  # row b's generator is seeded SEED + b, in the proposer and in the reference


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    make_tiny_checkpoint("llama", target_dir)
    return target_dir


@pytest.fixture(scope="module")
def models(target_dir, tmp_path_factory):
    """(target, head directory, head): a tiny Llama and a random EAGLE-3 head with a peaked LM head, so that
    draft confidences spread over (0, 1) instead of sitting near 1 / vocab."""
    head_dir = tmp_path_factory.mktemp("head")
    torch.manual_seed(0)
    target = load_target(target_dir, dtype="float32")
    config = DraftHeadConfig.for_target("eagle3", target.config, (1, 2, 3), 64, "tiny")
    head = resolve_method("eagle3").head_module(config).attach_target(target)
    head.set_vocab(torch.arange(0, 128, 2))  # draft id i is target id 2i: the id mapping is exercised
    with torch.no_grad():
        head.lm_head.weight.mul_(8)
    head.save_pretrained(head_dir)
    return target, head_dir


@pytest.fixture(scope="module")
def mtp_models(models, target_dir, tmp_path_factory):
    """The same target with a random MTP layer (MiMo's layout: the normed state fed back), its readout
    sharpened like the EAGLE-3 head's LM head."""
    import json

    from draftsmith.methods.mtp.head import MTPHead

    target, _ = models
    head_dir = tmp_path_factory.mktemp("mtp")
    torch.manual_seed(0)
    head = MTPHead.for_target(target.config, json.loads((target_dir / "config.json").read_text()))
    head.attach_target(target)
    with torch.no_grad():
        head.layers[0].final_norm.weight.mul_(8)
    head.save_pretrained(head_dir)
    return target, head_dir


@pytest.fixture(scope="module")
def windowed_models(models, tmp_path_factory):
    """The same target with an EAGLE-3 head whose attention window (5) is shorter than most rows' context,
    with the other variants a speculators-trained head has."""
    target, _ = models
    head_dir = tmp_path_factory.mktemp("windowed")
    torch.manual_seed(0)
    config = DraftHeadConfig.for_target("eagle3", target.config, (1, 2, 3), 64, "tiny", sliding_window=5,
                                        norm_before_residual=True, norm_before_fc=True, norm_output=True)
    head = resolve_method("eagle3").head_module(config).attach_target(target)
    head.set_vocab(torch.arange(0, 128, 2))
    with torch.no_grad():
        head.lm_head.weight.mul_(8)
    head.save_pretrained(head_dir)
    return target, head_dir


@pytest.fixture(scope="module")
def windowed_eagle1_models(models, tmp_path_factory):
    """The same target with an EAGLE-1 head (its one variant: a window of 5) reading out through the
    target's LM head."""
    target, _ = models
    head_dir = tmp_path_factory.mktemp("windowed_eagle1")
    torch.manual_seed(0)
    config = DraftHeadConfig.for_target("eagle", target.config, (target.config.num_hidden_layers,), None, "tiny",
                                        sliding_window=5)
    resolve_method("eagle").head_module(config).attach_target(target).save_pretrained(head_dir)
    return target, head_dir


def make_proposer(models, max_num_seqs: int = 4, sampled: bool = False):
    import json

    target, head_dir = models
    method = json.loads((head_dir / "config.json").read_text())["draftsmith_head_type"]
    # float32: the per-row reference must agree to the last bit, whatever batch shapes the proposer runs
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": K, "draft_dtype": "float32"}
    if sampled:
        spec["draft_sample_method"] = "probabilistic"
    return resolve_method(method).proposer_class()(parse_speculative_config(spec), target, max_num_seqs, MAX_LEN)


def features_of(proposer, ids: list[int]) -> torch.Tensor:
    """[len(ids), F] target features of every position (causal, so earlier ones do not depend on later ids)."""
    with torch.inference_mode():
        out = proposer.head.target(torch.tensor([ids]), feature_layers=proposer.feature_layers)
        return proposer.features(out.hidden_states)[0]


def observe(proposer, rows: list[Row], counts: list[int], extra: list[list[int]] | None = None,
            starts: list[int] | None = None) -> None:
    """The engine's call after a forward: row b verified `counts[b]` positions from starts[b] (default: its
    last token, or 0 while it has no output), whose ids past the row's end are `extra[b]` (accepted drafts)."""
    extra = extra or [[] for _ in rows]
    starts = starts or [r.num_tokens - 1 if r.output_token_ids else 0 for r in rows]
    per_row = [features_of(proposer, row.all_token_ids() + more) for row, more in zip(rows, extra)]
    feats = torch.zeros(len(rows), max(counts), per_row[0].shape[-1])
    for b, (start, count) in enumerate(zip(starts, counts)):
        feats[b, :count] = per_row[b][start : start + count]
    proposer.observe(rows, starts, counts, feats)


@torch.inference_mode()
def reference(proposer, row: Row, limit: int, temperature: float = 0.0, generator=None, context_start: int = 0):
    """One row alone, old-style: (target ids, probability of each, q over the draft vocab per draft). The
    head sees positions from `context_start` on, run from a fresh cache whose slot 0 holds that position: no
    mask is needed to hide what came before."""
    head, ids = proposer.head, row.all_token_ids()
    c = context_start
    n = len(ids) - 1 - c  # verified positions c..c+n-1 pair with tokens c+1..c+n
    cache = head.make_cache(1, MAX_LEN)
    window = head.sliding_window  # the catch-up slides by position; drafts read from W before them on
    batch = ForwardBatch.build([0], [0], [n], cache, window)
    # the cache from slot 0, rope and the head's own position rules (MTP's position 0) at the real positions
    out, logits = head.step(torch.tensor([ids[c + 1:]]), features_of(proposer, ids)[None, c : c + n],
                            batch.positions + c, True, cache, batch)
    state, logit = out[:, -1], logits[0, -1]
    tokens, probs, qs = [], [], []
    for s in range(limit):
        if s:
            draft_keys = None if window is None else [max(n - window, 0)]
            batch = ForwardBatch.build([0], [n + s - 1], [1], cache, key_starts=draft_keys)
            out, logits = head.step(torch.tensor([[tokens[-1]]]), state[:, None], batch.positions + c, False, cache,
                                    batch)
            state, logit = out[:, 0], logits[0, 0]
        q = torch.softmax(logit.float() / (temperature or 1.0), -1)
        if temperature:
            draft = int((q / torch.ones_like(q).exponential_(generator=generator)).argmax())
        else:
            draft = int(q.argmax())
        tokens.append(int(head.to_target_ids(torch.tensor(draft))))
        probs.append(float(q[draft]))
        qs.append(q)
    return tokens, probs, qs


def check_against_reference(proposer, rows, limits, drafts, sampling=None, temperatures=None):
    """Each row's drafts, probability products and q equal the reference's; with `sampling`, each row's
    generator also advanced exactly as far as the reference's copy (one draw per draft, none past it)."""
    for b, (row, limit) in enumerate(zip(rows, limits)):
        generator = torch.Generator().manual_seed(SEED + b) if sampling else None
        tokens, probs, qs = reference(proposer, row, limit, temperatures[b] if sampling else 0.0, generator,
                                      int(proposer.pending.context_start[row.slot]))
        assert drafts.counts[b] == limit
        assert drafts.tokens[b].tolist() == tokens + [-1] * (K - limit), f"row {b}"
        expected = torch.tensor(probs).cumprod(0) if probs else torch.zeros(0)
        torch.testing.assert_close(proposer.last_confidence[b, :limit], expected, atol=PROB_ATOL, rtol=0)
        assert (proposer.last_confidence[b, limit:] == 0).all()
        if sampling is not None:
            assert torch.equal(sampling.generators[b].get_state(), generator.get_state()), f"row {b}"
            for s, q in enumerate(qs):
                torch.testing.assert_close(drafts.probs[b, s, proposer.draft_to_target], q, atol=PROB_ATOL, rtol=0)


def sampling_for(temperatures: list[float]) -> SamplingBatch:
    generators = [torch.Generator().manual_seed(SEED + b) for b in range(len(temperatures))]
    return SamplingBatch.build([SamplingParams(temperature=t) for t in temperatures], generators, "cpu")


def verify_step(proposer, rows, drafts, gen: torch.Generator) -> None:
    """Accepts a random prefix of each row's drafts, observes it, then appends it and a new token."""
    accepted, counts = [], []
    for b in range(len(rows)):
        n = int(torch.randint(0, int(drafts.counts[b]) + 1, (1,), generator=gen))
        accepted.append(drafts.tokens[b, :n].tolist())
        counts.append(n + 1)
    observe(proposer, rows, counts, accepted)
    for row, kept in zip(rows, accepted):
        row.output_token_ids += kept + [int(torch.randint(0, 128, (1,), generator=gen))]


def prefill(proposer, rows: list[Row], gen: torch.Generator) -> None:
    observe(proposer, rows, [len(r.prompt_token_ids) for r in rows])
    for row in rows:
        row.output_token_ids.append(int(torch.randint(0, 128, (1,), generator=gen)))


def random_rows(gen, lengths, slots):
    return [Row(f"r{slot}", slot, torch.randint(0, 128, (n,), generator=gen).tolist()) for n, slot in zip(lengths, slots)]


@pytest.mark.parametrize("head", ["models", "mtp_models"])
@pytest.mark.parametrize("sampled", [False, True])
def test_mixed_batch_matches_the_per_row_reference(head, sampled, monkeypatch, request):
    """Limits 0, 1, k and in between, prompts shorter and longer than the pending buffer (the head's context
    then starts at the prompt's last W positions), slots out of order, several rounds with random
    acceptance (pending lengths 1..k+1), and a row whose limit 0 makes its pending accumulate; an EAGLE-3
    head and an MTP layer."""
    monkeypatch.setattr(pending_module, "MAX_PENDING", 2 * (K + 1))
    gen = torch.Generator().manual_seed(1)
    proposer = make_proposer(request.getfixturevalue(head), sampled=sampled)
    rows = random_rows(gen, [3, 30, 7, 12], [2, 0, 3, 1])
    temperatures = [0.0, 0.7, 1.0, 1.3] if sampled else None
    prefill(proposer, rows, gen)
    width = proposer.pending.width
    assert width == 2 * (K + 1)
    assert proposer.pending.length == [width, width, 3, 7]  # by slot
    assert proposer.pending.context_start == [30 - width, 12 - width, 0, 0]
    for limits in ([0, 1, K, 2], [K, 0, 3, K], [2, K, 0, 1], [K, K, K, 0]):
        sampling = sampling_for(temperatures) if sampled else None
        drafts = proposer.propose(rows, limits, sampling)
        assert drafts.forwards == max(limits)
        check_against_reference(proposer, rows, limits, drafts, sampling, temperatures)
        verify_step(proposer, rows, drafts, gen)


@pytest.mark.parametrize("head", ["models", "mtp_models"])
def test_drafts_are_what_training_unrolls(head, request):
    """Serving and training run one model: a row's k drafts are the argmax of the training unroll's steps
    at the row's last verified position, unrolled over the row with its drafts appended (step s reads the
    token s after the row's last, which is draft s). Position, pairing, feedback or mask slips show here."""
    from draftsmith.methods.eagle.training import unroll

    gen = torch.Generator().manual_seed(3)
    proposer = make_proposer(request.getfixturevalue(head))
    rows = random_rows(gen, [9, 20], [1, 0])
    prefill(proposer, rows, gen)
    drafts = proposer.propose(rows, [K, K])
    with torch.inference_mode():
        for b, row in enumerate(rows):
            drafted = drafts.tokens[b].tolist()
            ids = row.all_token_ids() + drafted
            steps = unroll(proposer.head, torch.tensor([ids]), features_of(proposer, ids)[None], K)
            last = row.num_tokens - 2  # the newest position with a verified feature
            unrolled = [int(proposer.head.to_target_ids(logits[0, last].argmax())) for _, logits in steps]
            assert unrolled == drafted, f"row {b}"


@pytest.mark.parametrize("head", ["windowed_models", "windowed_eagle1_models"])
def test_a_windowed_head_drafts_as_trained(head, monkeypatch, request):
    """A head with a window shorter than the rows' contexts (EAGLE-3's variant, and EAGLE-1's one): the catch-up
    slides it by position, and draft step s reads the verified prefix's newest W positions plus its own
    drafts, as speculators' training mask has it (see `_step_batches`)."""
    monkeypatch.setattr(pending_module, "MAX_PENDING", 2 * (K + 1))
    gen = torch.Generator().manual_seed(2)
    proposer = make_proposer(request.getfixturevalue(head))
    rows = random_rows(gen, [3, 30, 7, 12], [2, 0, 3, 1])
    prefill(proposer, rows, gen)
    for limits in ([K, 1, K, 2], [K, K, 3, K], [2, K, K, 1]):
        drafts = proposer.propose(rows, limits)
        check_against_reference(proposer, rows, limits, drafts)
        verify_step(proposer, rows, drafts, gen)


def test_a_joining_row_catches_up_apart_from_steady_ones(models):
    """A request joining a drafting batch brings a prompt's worth of pending positions: its catch-up runs as
    a head forward of its own (padded into the steady rows' one, it made every row pay for its width), and
    every row drafts what the reference drafts."""
    gen = torch.Generator().manual_seed(3)
    proposer = make_proposer(models)
    rows = random_rows(gen, [6, 9], [0, 1])
    prefill(proposer, rows, gen)
    verify_step(proposer, rows, proposer.propose(rows, [K, K]), gen)  # one verify step pending each now
    joining = random_rows(gen, [40], [2])
    prefill(proposer, joining, gen)
    batch = rows + joining
    assert proposer.catch_up(batch) == (1, 40 - (K + 1))
    forwards = []
    real = proposer._catch_up_rows
    proposer._catch_up_rows = lambda rows_, slots_: forwards.append(slots_) or real(rows_, slots_)
    drafts = proposer.propose(batch, [K, K, K])
    assert forwards == [[0, 1], [2]] and not drafts.steady
    check_against_reference(proposer, batch, [K, K, K], drafts)


def test_observe_accumulates_until_propose(models, monkeypatch):
    """Steps that skip speculation keep handing over positions: twice below the buffer width, then a
    verify step whose accepted drafts overflow a partly filled buffer, then single positions that overflow
    it again and again (each overflow flushed), and the next propose drafts what the reference drafts."""
    monkeypatch.setattr(pending_module, "MAX_PENDING", 2 * (K + 1))
    gen = torch.Generator().manual_seed(2)
    proposer = make_proposer(models)
    rows = random_rows(gen, [4, K], [0, 1])  # no longer than a verify step: left pending, not flushed
    prefill(proposer, rows, gen)

    def skipped_step(counts):
        extra = [torch.randint(0, 128, (n - 1,), generator=gen).tolist() for n in counts]
        observe(proposer, rows, counts, extra)
        for row, accepted in zip(rows, extra):
            row.output_token_ids += accepted + [int(torch.randint(0, 128, (1,), generator=gen))]

    for _ in range(2):
        skipped_step([1, 1])
    assert proposer.pending.length[:2] == [4 + 2, K + 2]  # two observes, one pending run each
    width = proposer.pending.width
    skipped_step([K + 1, 2])
    # row 0 overflowed by one: it keeps the newest W positions, and the head's context starts at them
    assert proposer.pending.length[:2] == [width, K + 4]
    assert proposer.pending.context_start[:2] == [1, 0]
    for _ in range(3 * width):
        skipped_step([1, 1])
    assert proposer.pending.length[:2] == [width, width]
    # the newest W verified positions are pending: the last one is the row's second-to-last token
    assert proposer.pending.context_start[:2] == [r.num_tokens - 1 - width for r in rows]
    assert proposer.catch_up(rows) == (2, width - (K + 1))  # what the policy prices
    drafts = proposer.propose(rows, [K, K])
    check_against_reference(proposer, rows, [K, K], drafts)


@pytest.mark.parametrize("sampled", [False, True])
def test_confidence_floor_stops_the_loop(models, sampled):
    """With stop_below, the loop goes on while the rows' mean running probability product (0 for a row at its
    limit) stays at or above it; every row keeps its drafts up to the steps run and its limit (none is cut
    alone), last_confidence is 0 past them, and a sampled row drew once per draft it kept."""
    gen = torch.Generator().manual_seed(3)
    rows = random_rows(gen, [5, 11, 8, 6], [0, 1, 2, 3])
    prefill(make_proposer(models), rows, gen)  # only fixes the rows' output tokens
    limits, temperatures = [K, K, 2, 0], [1.0, 0.0, 0.8, 1.0]
    free, floored, closed = (make_proposer(models, sampled=sampled) for _ in range(3))
    for proposer in (free, floored, closed):
        observe(proposer, rows, [len(r.prompt_token_ids) for r in rows], starts=[0] * len(rows))
    sampling = sampling_for(temperatures) if sampled else None
    full = free.propose(rows, limits, sampling)
    check_against_reference(free, rows, limits, full, sampling, temperatures)
    products = free.last_confidence.clone()
    # the mean chance of reaching draft s + 2, which decides whether step s + 2 runs
    reach = [float(torch.where(torch.tensor(limits) > s + 1, products[:, s], 0.0).mean()) for s in range(K - 1)]
    assert reach[0] >= reach[1] >= reach[2] > 0, reach
    floor = (reach[1] + reach[2]) / 2  # steps 1-3 run, step 4 does not
    sampling = sampling_for(temperatures) if sampled else None
    drafts = floored.propose(rows, limits, sampling, stop_below=floor)
    assert drafts.forwards == 3, (reach, products)
    kept = [min(n, 3) for n in limits]
    assert drafts.counts.tolist() == kept
    for b, n in enumerate(kept):
        assert drafts.tokens[b].tolist() == full.tokens[b, :n].tolist() + [-1] * (K - n)
        torch.testing.assert_close(floored.last_confidence[b, :n], products[b, :n], atol=PROB_ATOL, rtol=0)
        assert (floored.last_confidence[b, n:] == 0).all()
        if sampled:
            reference_generator = torch.Generator().manual_seed(SEED + b)
            for _ in range(n if temperatures[b] > 0 else 0):
                torch.empty(64).exponential_(generator=reference_generator)
            assert torch.equal(sampling.generators[b].get_state(), reference_generator.get_state()), f"row {b}"
    # a floor above every chance: only the catch-up runs, and each row that may draft keeps its first draft
    drafts = closed.propose(rows, limits, sampling_for(temperatures) if sampled else None, stop_below=reach[0] * 1.001)
    assert drafts.forwards == 1
    assert drafts.counts.tolist() == [min(1, n) for n in limits]
    assert drafts.tokens[:, 0].tolist() == full.tokens[:, 0].tolist() and (drafts.tokens[:, 1:] == -1).all()


def test_released_slot_starts_clean(models, monkeypatch):
    """A slot reused by another request drafts from that request's features only, and over its whole
    context, whether its previous owner left pending positions behind, had them consumed by a propose, or
    had a context starting mid-sequence."""
    monkeypatch.setattr(pending_module, "MAX_PENDING", 2 * (K + 1))
    gen = torch.Generator().manual_seed(4)
    proposer = make_proposer(models)
    first = random_rows(gen, [14, 6], [0, 1])
    prefill(proposer, first, gen)
    assert proposer.pending.context_start[:2] == [14 - proposer.pending.width, 0]
    proposer.propose(first[:1], [K])  # slot 0 consumed its pending, slot 1 still holds some
    for row in first:
        proposer.release(row)
    second = [Row("new0", 0, torch.randint(0, 128, (5,), generator=gen).tolist()),
              Row("new1", 1, torch.randint(0, 128, (14,), generator=gen).tolist())]
    prefill(proposer, second, gen)
    assert proposer.pending.context_start[:2] == [0, 14 - proposer.pending.width]
    drafts = proposer.propose(second, [K, 3])
    check_against_reference(proposer, second, [K, 3], drafts)


def test_plain_steps_kept_for_later_replay_as_if_observed(models, monkeypatch):
    """Plain steps handed over by reference (`observe_later`) are built and observed only when drafting
    resumes: a stretch shorter than the buffer, then one that overflows the kept steps (the oldest dropped;
    the context restarts after the gap, as the ring keeps no more anyway), with a row released and its slot
    reused in between. The policy's catch-up estimate is right before the replay, and the next propose
    drafts what the per-row reference drafts from the same context."""
    monkeypatch.setattr(pending_module, "MAX_PENDING", 2 * (K + 1))
    gen = torch.Generator().manual_seed(5)
    eager, lazy = make_proposer(models), make_proposer(models)
    rows = random_rows(gen, [5, 7], [0, 1])
    for proposer in (eager, lazy):
        observe(proposer, rows, [len(r.prompt_token_ids) for r in rows])
    for row in rows:
        row.output_token_ids.append(int(torch.randint(0, 128, (1,), generator=gen)))

    def plain_step():
        starts = [r.num_tokens - 1 for r in rows]
        with torch.inference_mode():
            hidden = [lazy.head.target(torch.tensor([r.all_token_ids()]), feature_layers=lazy.feature_layers)
                      .hidden_states for r in rows]
        stacked = {i: torch.cat([h[i][:, s : s + 1] for h, s in zip(hidden, starts)]) for i in hidden[0]}
        eager.observe(rows, starts, [1] * len(rows), eager.features(stacked))
        assert lazy.observe_later(rows, starts, stacked)
        for row in rows:
            row.output_token_ids.append(int(torch.randint(0, 128, (1,), generator=gen)))

    for steps in (3, 3 * lazy.observe_window):
        for _ in range(steps):
            plain_step()
        assert lazy.catch_up(rows) == eager.catch_up(rows)
        drafts = lazy.propose(rows, [K, K])  # replays first
        expected = eager.propose(rows, [K, K])
        assert lazy.pending.context_start[:2] == eager.pending.context_start[:2]
        assert torch.equal(drafts.tokens, expected.tokens)
        check_against_reference(lazy, rows, [K, K], drafts)
        for proposer in (eager, lazy):  # the drafts are all rejected: the last token and a new one
            observe(proposer, rows, [1, 1])
        for row in rows:
            row.output_token_ids.append(int(torch.randint(0, 128, (1,), generator=gen)))
        if steps == 3:  # row 1 finishes; a new request takes its slot while steps are kept
            plain_step()
            for proposer in (eager, lazy):
                proposer.release(rows[1])
            rows[1] = random_rows(gen, [6], [1])[0]
            for proposer in (eager, lazy):
                observe(proposer, rows[1:], [6])
            rows[1].output_token_ids.append(int(torch.randint(0, 128, (1,), generator=gen)))


def test_engine_prefill_hands_over_each_prompts_newest_positions():
    """The engine's prefill asks the target for the hidden states of each row's newest `observe_window`
    prompt positions only (rows of unequal lengths in one packed forward, and a prompt in chunks); the
    proposer's ring then holds exactly what a full forward gives at those positions."""
    config = {"method": "eagle3", "model": str(REPO / "assets" / "demo-code-7m-eagle3"), "num_speculative_tokens": 3}
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=400,
              max_num_batched_tokens=256, speculative_config=config)
    engine, proposer = llm.engine, llm.engine.proposer
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (300, 90, 20)]
    for ids in prompts:
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4))
    asked, forward = [], engine._forward
    engine._forward = lambda *a: asked.append(a[3] is not None) or forward(*a)
    engine._admit()
    while any(r.prefilling for r in engine.running):
        engine._prefill([r for r in engine.running if r.prefilling])
    assert any(asked) and not all(asked)  # the 300-token prompt in chunks of 256 and 44: windowed, then not
    width = proposer.pending.width
    for request, ids in zip(sorted(engine.running, key=lambda r: r.slot), prompts):
        slot, kept = request.slot, min(len(ids), width)
        assert (proposer.pending.start[slot], proposer.pending.length[slot]) == (len(ids) - kept, kept)
        positions = torch.arange(len(ids) - kept, len(ids))
        torch.testing.assert_close(proposer.pending.ring[slot, positions % width], features_of(proposer, ids)[positions],
                                   atol=2e-2, rtol=2e-2)  # bf16 features, batched differently


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_a_row_at_the_end_of_its_context_beside_rows_drafting_more(method):
    """Draft steps run every row at one width: a row whose context is nearly full (its limit 0-2) goes on
    beside rows drafting 5, into room past max_model_len, with greedy equality (it used to index past the
    head's cache)."""
    from helpers import CODE_PROMPTS

    kwargs = dict(dtype="float32", device="cpu", max_num_seqs=3, max_model_len=48)
    plain = LLM(DEMO_MODEL, **kwargs)
    prompts = [{"prompt_token_ids": plain.encode(CODE_PROMPTS[1] * 3)[1][:40]}, *CODE_PROMPTS[:2]]
    params = SamplingParams(temperature=0, max_tokens=40)
    reference = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    llm = LLM(DEMO_MODEL, **kwargs, speculative_config=spec_config(method, REPO / "assets" / f"demo-code-7m-{method}", 5))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
