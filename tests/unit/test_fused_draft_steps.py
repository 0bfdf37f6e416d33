"""A recurrent head's draft steps and catch-up as one C++ op (models/draft_step_cpu.cpp, `FusedDraftSteps`):
the eager forward's head outputs, logits and cache writes bit for bit, for EAGLE-3 (and its variants the op
runs), EAGLE-1 and MTP heads, over rows of their own slots, positions, first keys and pending counts; the
eager CPU engine drafts with it as with eager forwards and decodes as plain decoding; the variants it does
not run, `DRAFTSMITH_ATTENTION=torch` and `DRAFTSMITH_CPU_OPS=torch` keep eager forwards."""

import json
from dataclasses import replace

import pytest
import torch

from draftsmith.methods import resolve_method
from draftsmith.models import DraftHeadConfig, ForwardBatch, kv_cache, step_ops_cpu
from draftsmith.models.draft_step_cpu import FusedDraftSteps
from draftsmith.serve import LLM, SamplingParams
from helpers import CODE_PROMPTS, DEMO_MODEL, panel_gemm_missing, spec_config

WHY_NOT = panel_gemm_missing("a head's projections stay on oneDNN, and its forwards eager")
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))

MAX_LEN = 96


def _head(target, head_type: str = "eagle3", seed: int = 0, **variant):
    """A random one-layer head on the demo target: EAGLE-3 (a draft vocabulary of every other id), EAGLE-1 or
    MTP."""
    torch.manual_seed(seed)
    if head_type == "mtp":
        from draftsmith.methods.mtp.head import MTPHead

        source = json.loads((DEMO_MODEL / "config.json").read_text())
        head = MTPHead.for_target(target.config, source).attach_target(target)
    else:
        layers = (1, 3, 5) if head_type == "eagle3" else (target.config.num_hidden_layers,)
        vocab = target.config.vocab_size // 2 if head_type == "eagle3" else None
        config = DraftHeadConfig.for_target(head_type, target.config, layers, vocab, **variant)
        head = resolve_method(head_type).head_module(config).attach_target(target)
        if head_type == "eagle3":
            head.set_vocab(torch.arange(0, target.config.vocab_size, 2))
    head.init_rope(MAX_LEN)
    return head.eval()


def _next_ids(head, logits: torch.Tensor) -> torch.Tensor:
    """Greedy drafts as target ids (an EAGLE-3 head's logits are over its draft vocabulary)."""
    ids = logits.argmax(-1)
    return head.to_target_ids(ids) if hasattr(head, "d2t") else ids


def _filled_caches(head, count: int, generator: torch.Generator):
    """`count` caches of the head holding the same random keys and values."""
    caches = [head.make_cache(4, MAX_LEN) for _ in range(count)]
    for layer in range(len(caches[0].k)):
        for name in ("k", "v"):
            filled = torch.randn(getattr(caches[0], name)[layer].shape, generator=generator)
            for cache in caches:
                getattr(cache, name)[layer].copy_(filled)
    return caches


def _eager_steps(head, cache, slots, base, key_starts, ids, state, steps):
    """The proposer's eager draft loop (`_step_batches`, `Eagle3Head.step`) -> [(output, logits)] per step."""
    whole = ForwardBatch.build(slots, base, [steps] * len(slots), cache, None, "cpu", key_starts=key_starts)
    out = []
    for s in range(steps):
        step = {"positions": whole.positions[:, s : s + 1], "write_slots": whole.write_slots[:, s : s + 1],
                "mask": whole.mask[:, :, s : s + 1]}
        if whole.key_positions is None:
            kv_len = min(max(base) + s + 1, whole.kv_len)
            step.update(mask=step["mask"][..., : kv_len - whole.kv_start], kv_len=kv_len)
        batch = replace(whole, **step)
        state, logits = (t[:, 0] for t in head.step(ids[:, None], state[:, None], batch.positions, False, cache, batch))
        out.append((state, logits))
        ids = _next_ids(head, logits)
    return out


VARIANTS = {"EAGLE-3": {}, "EAGLE-3, normed residual": {"norm_before_residual": True},
            "EAGLE-3, normed output": {"norm_output": True},
            "EAGLE-3, normed features and its own embedding": {"norm_before_fc": True, "own_embedding": True},
            "EAGLE-3, a norm per feature layer": {"fc_norm": True},
            "EAGLE-3, biased attention": {"attention_bias": True}, "EAGLE-3, a window": {"sliding_window": 8},
            "EAGLE-1": {"head_type": "eagle"}, "EAGLE-1, a window": {"head_type": "eagle", "sliding_window": 8},
            "MTP": {"head_type": "mtp"}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_steps_compute_the_eager_steps_bit_for_bit(target, variant, monkeypatch):
    """Rows whose contexts lie far apart, which an eager step's ForwardBatch would gather keys for (PyTorch's
    attention, summing in another order): here it attends through the slot kernel too, as the fused op does."""
    monkeypatch.setattr(kv_cache, "GATHER_KEYS_FROM", float("inf"))
    head = _head(target, **VARIANTS[variant])
    if variant == "EAGLE-3, biased attention":
        with torch.no_grad():
            for proj in (head.midlayer.self_attn.q_proj, head.midlayer.self_attn.k_proj, head.midlayer.self_attn.v_proj):
                proj.bias.normal_()
    generator = torch.Generator().manual_seed(1)
    # rows whose context starts mid-sequence, the last one's steps past the cache's end (its last position)
    slots, base, key_starts = [2, 0, 3, 1], [17, 40, 63, MAX_LEN - 2], [0, 9, 30, 60]
    caches = _filled_caches(head, 2, generator)
    ids = torch.tensor([5, 901, 77, 1200])
    state = torch.randn(4, target.config.hidden_size, generator=generator)
    with torch.inference_mode():
        want = _eager_steps(head, caches[0], slots, base, key_starts, ids, state, steps=3)
        runner = FusedDraftSteps.for_head(head, caches[1])
        assert runner is not None, "the fused steps do not run this head"
        runner.begin(slots, base, key_starts)
        got_state, got_ids = state, ids
        for s, (want_state, want_logits) in enumerate(want):
            got_state, logits = runner.step(got_ids, got_state)
            assert torch.equal(got_state, want_state), f"step {s}: head output differs"
            assert torch.equal(logits, want_logits), f"step {s}: logits differ"
            got_ids = _next_ids(head, logits)
    assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_catch_up_computes_the_eager_catch_up_bit_for_bit(target, variant, monkeypatch):
    """Rows of 4, 1 and 6 pending positions (padded to 6; one from position 0, where MTP's embedding is zero)
    through the head from target features, as the proposer's eager catch-up runs them (its head's window
    included): the output and logits at each row's last position, and the cache writes."""
    monkeypatch.setattr(kv_cache, "GATHER_KEYS_FROM", float("inf"))
    head = _head(target, **VARIANTS[variant])
    generator = torch.Generator().manual_seed(2)
    slots, first, held, key_starts = [1, 3, 0], [0, 30, 51], [4, 1, 6], [0, 12, 40]
    caches = _filled_caches(head, 2, generator)
    width, features = max(held), len(head.feature_layers) * target.config.hidden_size
    ids = torch.randint(0, target.config.vocab_size, (3, width), generator=generator)
    hidden = torch.randn(3, width, features, generator=generator)
    window = head.sliding_window
    with torch.inference_mode():
        batch = ForwardBatch.build(slots, first, held, caches[0], window, "cpu", key_starts=key_starts)
        last = torch.tensor([n - 1 for n in held])
        out, logits = head.step(ids, hidden, batch.positions, True, caches[0], batch, logits_at=last)
        runner = FusedDraftSteps.for_head(head, caches[1])
        got_state, got_logits = runner.catch_up(ids, hidden, first, held, slots, key_starts, window)
    assert torch.equal(got_state, out[torch.arange(3), last])
    assert torch.equal(got_logits, logits[:, 0])
    for eager, fused in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):  # the scratch slot aside
        assert torch.equal(eager[:-1], fused[:-1])


def _stepwise_loop(runner, head, ids, state, steps, limits, stop_below, batch_rows):
    """The proposer's greedy loop over the runner's one-token steps (`EagleFamilyProposer._draft` from its
    second step): -> (drafted, probs, steps run); ids and state are step 0's."""
    rows, k = ids.shape[0], 6
    drafted, probs = torch.full((rows, k), -1, dtype=torch.long), torch.zeros(rows, k)
    product = torch.ones(rows)
    for s in range(1, steps):
        state, logits = runner.step(ids, state)
        ids, probs[:, s] = step_ops_cpu.greedy_pick(logits, head.draft_offsets())
        drafted[:, s] = ids
        if stop_below > 0 and s + 1 < steps:
            product = product * probs[:, s]
            going = product if limits is None else torch.where(limits > s + 1, product, 0.0)
            if float(going.sum()) < stop_below * batch_rows:
                return drafted, probs, s + 1
    return drafted, probs, steps


@pytest.mark.parametrize("variant", ["EAGLE-3", "EAGLE-3, normed output", "EAGLE-1", "MTP"])
def test_fused_greedy_loop_drafts_as_its_steps_one_by_one(target, variant):
    """`greedy_steps` (one op for draft steps 2..k) against the same runner stepped one step at a time with the
    proposer's pick and stopping rule: the same drafts, probabilities, steps run and cache writes, with every
    row drafting every step, with rows at their limits, and stopping early (stop_below between the batch's
    chances after steps 2 and 3)."""
    head = _head(target, **VARIANTS[variant])
    generator = torch.Generator().manual_seed(3)
    slots, base, key_starts = [2, 0, 3], [17, 40, 63], [0, 9, 30]
    ids = torch.tensor([5, 901, 77])
    state = torch.randn(3, target.config.hidden_size, generator=generator)
    steps, limits = 5, torch.tensor([5, 2, 3])
    with torch.inference_mode():
        caches = _filled_caches(head, 2, generator)
        runners = [FusedDraftSteps.for_head(head, cache) for cache in caches]
        runners[0].begin(slots, base, key_starts)
        _, full_probs, _ = _stepwise_loop(runners[0], head, ids, state, steps, None, 0.0, 3)
        chances = full_probs[:, 1:].cumprod(1).sum(0)  # the batch's chance after steps 2, 3, ...
        early = float(chances[1] + chances[2]) / 2 / 3
        for row_limits, stop_below in ((None, 0.0), (limits, 0.0), (None, early), (limits, early)):
            for runner in runners:
                runner.begin(slots, base, key_starts)
            want = _stepwise_loop(runners[0], head, ids, state, steps, row_limits, stop_below, 3)
            drafted, probs = torch.full((3, 6), -1, dtype=torch.long), torch.zeros(3, 6)
            ran = runners[1].greedy_steps(ids, state, 1, steps, head.draft_offsets(), drafted, probs, torch.ones(3),
                                          row_limits, stop_below, 3)
            assert ran == want[2] and torch.equal(drafted, want[0]) and torch.equal(probs, want[1])
            assert all(torch.equal(a, b) for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
            if stop_below and row_limits is None:
                assert ran == 4 < steps, "the early stop did not stop after step 3 (the fourth draft)"
            elif stop_below:  # rows at their limits count nothing toward going on: it stops no later
                assert ran <= 4


def test_the_proposers_draft_loop_through_the_op_drafts_as_stepping_from_python(target):
    """`EagleFamilyProposer._draft` with rows of uneven limits and a confidence floor that stops it early: through
    the loop op and stepping the runner from Python, the same drafts, confidences and draft forwards (the
    product handed over after the first draft, the limits masking the floor)."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              speculative_config=spec_config("eagle3", SHIPPED["eagle3"], 5))
    proposer = llm.engine.proposer
    generator = torch.Generator().manual_seed(4)
    state = torch.randn(3, target.config.hidden_size, generator=generator)
    logits = torch.randn(3, proposer.head.draft_vocab_size, generator=generator)
    slots, base, limits = [0, 1, 2], [12, 30, 47], [5, 2, 4]

    def draft(stop_below: float, loop: bool):
        proposer.draft_steps.greedy_steps = FusedDraftSteps.greedy_steps.__get__(proposer.draft_steps) if loop else None
        with torch.inference_mode():
            return proposer._draft(state, logits, slots, base, limits, None, [], None, 3, stop_below)

    _, full, forwards = draft(0.0, loop=False)
    assert forwards == 5
    going = full * (torch.tensor(limits)[:, None] > torch.arange(1, 6)[None, :])  # rows still drafting after step s
    floor = float(going[:, 2].sum() + going[:, 3].sum()) / 2 / 3  # between the chances after steps 2 and 3
    for stop_below in (0.0, floor):
        stepped, looped = draft(stop_below, loop=False), draft(stop_below, loop=True)
        assert looped[2] == stepped[2] and torch.equal(looped[0], stepped[0]) and torch.equal(looped[1], stepped[1])
    assert looped[2] == 4, "the floor did not stop the loop after its fourth draft"


def test_the_adaptive_policy_prices_draft_steps_by_timing_the_fused_step(target, greedy_reference):
    """An adaptive engine whose head drafts through the fused op prices a draft forward by the fused step timed
    at load for each batch size up to its slots (`EagleFamilyProposer.draft_timer`), not by a third of the
    target's decode; the timing writes only scratch positions: the output is plain decoding's."""
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              speculative_config=spec_config("eagle3", SHIPPED["eagle3"], 4, adaptive=True))
    cost = llm.engine.policy.cost
    assert isinstance(llm.engine.proposer.draft_steps, FusedDraftSteps)
    assert cost.draft_table is not None and cost.draft_table.rows == [1, 2]
    steps = [cost.draft_table.estimate(rows, 1) for rows in (1, 2)]
    assert cost.draft_table.key == {"drafting": "timed"} and all(seconds > 0 for seconds in steps)
    assert all(seconds < 2 * cost.forward(rows, 1) for seconds, rows in zip(steps, (1, 2)))  # a step, not a loop
    assert cost.drafting(2, 3) == pytest.approx(3 * steps[1])  # before any live timing
    outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == greedy_reference


def test_eager_draft_steps_are_not_timed_at_load(target, monkeypatch):
    """Without the fused op (`DRAFTSMITH_CPU_OPS=torch`), drafting is priced from the first guess until timed live."""
    monkeypatch.setenv(step_ops_cpu.VARIABLE, "torch")
    step_ops_cpu._allowed.cache_clear()
    try:
        llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256, target=target,
                  speculative_config=spec_config("eagle3", SHIPPED["eagle3"], 4, adaptive=True))
        assert llm.engine.proposer.draft_steps is None and llm.engine.policy.cost.draft_table is None
    finally:
        monkeypatch.delenv(step_ops_cpu.VARIABLE)
        step_ops_cpu._allowed.cache_clear()


@pytest.mark.parametrize("variant", [{"qk_norm": True}, {"num_hidden_layers": 2}])
def test_variants_the_op_does_not_run_keep_eager_steps(target, variant):
    head = _head(target, **variant)
    assert FusedDraftSteps.for_head(head, head.make_cache(2, MAX_LEN)) is None


def test_attention_other_than_the_slot_kernel_keeps_eager_steps(target, monkeypatch):
    """`DRAFTSMITH_ATTENTION=torch`: eager forwards attend through PyTorch, so the op (the slot kernel) stays out."""
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    head = _head(target)
    assert FusedDraftSteps.for_head(head, head.make_cache(2, MAX_LEN)) is None


def test_cpu_ops_turned_off_keep_eager_steps(target, monkeypatch):
    head = _head(target)
    monkeypatch.setenv(step_ops_cpu.VARIABLE, "torch")
    step_ops_cpu._allowed.cache_clear()
    try:
        assert FusedDraftSteps.for_head(head, head.make_cache(2, MAX_LEN)) is None
    finally:
        monkeypatch.delenv(step_ops_cpu.VARIABLE)
        step_ops_cpu._allowed.cache_clear()


SHIPPED = {"eagle3": DEMO_MODEL.parent / "demo-code-7m-eagle3", "eagle": DEMO_MODEL.parent / "demo-code-7m-eagle",
           "mtp": DEMO_MODEL.parent / "demo-code-7m-mtp"}


@pytest.mark.parametrize("method", SHIPPED)
def test_eager_engine_drafts_with_fused_steps_as_with_eager_ones(target, greedy_reference, method, monkeypatch):
    """A shipped demo head at fixed k = 4 on the eager CPU engine: its catch-ups and one-token steps are the
    fused op's, its drafts and their probabilities those of eager forwards (which attend through the slot
    kernel here too), and its output plain decoding's."""
    monkeypatch.setattr(kv_cache, "GATHER_KEYS_FROM", float("inf"))
    runs = []
    for fused in (True, False):
        llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
                  speculative_config=spec_config(method, SHIPPED[method], 4))
        proposer = llm.engine.proposer
        assert isinstance(proposer.draft_steps, FusedDraftSteps)
        fused_calls, loop_calls = [], []
        if fused:
            catch_up, loop = proposer.draft_steps.catch_up, proposer.draft_steps.greedy_steps
            proposer.draft_steps.catch_up = lambda *args, calls=fused_calls, run=catch_up: calls.append(1) or run(*args)
            proposer.draft_steps.greedy_steps = lambda *args, calls=loop_calls, run=loop: calls.append(1) or run(*args)
        else:
            proposer.draft_steps = None
        seen, propose = [], proposer.propose

        def recording(*args, propose=propose, seen=seen, proposer=proposer, **kwargs):
            out = propose(*args, **kwargs)
            seen.append((out.tokens.clone(), proposer.last_confidence.clone()))
            return out

        proposer.propose = recording
        outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        runs.append(([o.outputs[0].token_ids for o in outputs], seen))
        assert not fused or fused_calls, "no catch-up ran through the fused op"
        assert not fused or loop_calls, "no draft loop ran through the fused op"
    assert runs[0][0] == runs[1][0] == greedy_reference
    assert len(runs[0][1]) == len(runs[1][1]) and runs[0][1]
    for (tokens, confidence), (eager_tokens, eager_confidence) in zip(runs[0][1], runs[1][1]):
        assert torch.equal(tokens, eager_tokens) and torch.equal(confidence, eager_confidence)
