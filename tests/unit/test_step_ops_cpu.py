"""The C++ step ops of an eager CPU forward (models/step_ops_cpu.cpp) against PyTorch's ops: RMSNorm (to fp32
rounding: its sum runs in another order; bf16 to within one bf16 step), the residual add with its norm (the add
exactly, the norm bit for bit the norm op's), SiLU times up (to a few fp32 ulp), rope (bit for bit, fp32 and
bf16), the KV write (exactly) and a draft's greedy pick (the reference's ids, its probability to fp32 ulp);
where the model runs them (inference only, fp32 or bf16, loaded, not turned
off); and the engine's greedy ids with and without them."""

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_pick_reference import greedy_pick_reference
from draftsmith.methods.draft_sampling import pick_greedy
from draftsmith.models import slot_attention_cpu, step_ops_cpu
from draftsmith.models.config import TargetConfig
from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.llama import CausalLM, RMSNorm
from draftsmith.models.rope import _turn, apply_rope_qk

pytestmark = pytest.mark.skipif(slot_attention_cpu.build_error() is not None,
                                reason=f"the CPU kernels did not build: {slot_attention_cpu.build_error()}")


@pytest.fixture
def ops_on(monkeypatch):
    """The ops loaded and allowed, whatever the test before left."""
    monkeypatch.setattr(slot_attention_cpu, "LOADED", True)
    monkeypatch.delenv(step_ops_cpu.VARIABLE, raising=False)
    step_ops_cpu._allowed.cache_clear()
    yield
    step_ops_cpu._allowed.cache_clear()


@pytest.mark.parametrize("shape", [(1, 1, 256), (8, 1, 512), (3, 5, 256), (37, 64), (600, 256)])
def test_rms_norm_matches_pytorch(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    x, weight = 3 * torch.randn(shape, generator=generator), torch.randn(shape[-1], generator=generator)
    got = step_ops_cpu.rms_norm(x, weight, 1e-5)
    assert got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), weight, 1e-5), rtol=2e-6, atol=2e-6)
    strided = x.transpose(0, -2) if x.dim() == 3 else x[:, ::2]  # a view that is not contiguous
    torch.testing.assert_close(step_ops_cpu.rms_norm(strided, weight[: strided.shape[-1]], 1e-5),
                               F.rms_norm(strided, (strided.shape[-1],), weight[: strided.shape[-1]], 1e-5),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 256), (8, 1, 512), (3, 5, 256), (600, 64)])
def test_add_rms_norm_is_the_add_then_the_norm(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    x, residual = (3 * torch.randn(shape, generator=generator)).to(dtype), torch.randn(shape, generator=generator).to(dtype)
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    total, normed = step_ops_cpu.add_rms_norm(x, residual, weight, 1e-5)
    assert total.shape == normed.shape == x.shape and total.dtype == normed.dtype == dtype
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, step_ops_cpu.rms_norm(x + residual, weight, 1e-5))
    strided = x.transpose(0, -2) if x.dim() == 3 else x[:, ::2]  # a view that is not contiguous
    w = weight[: strided.shape[-1]]
    total, normed = step_ops_cpu.add_rms_norm(strided, strided, w, 1e-5)
    assert torch.equal(total, strided + strided) and torch.equal(normed, step_ops_cpu.rms_norm(total, w, 1e-5))
    with pytest.raises(RuntimeError, match="one shape"):
        step_ops_cpu.add_rms_norm(x, residual[..., :-1], weight, 1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 768), (8, 1, 1536), (3, 5, 100), (600, 37)])
def test_silu_mul_matches_pytorch_on_a_fused_projection(shape):
    """gate and up as `fused` leaves them: views into one [.., 2 x width] projection; values out to +-100, where
    the sigmoid saturates."""
    generator = torch.Generator().manual_seed(sum(shape))
    both = 6 * torch.randn(*shape[:-1], 2 * shape[-1], generator=generator)
    both[..., :3] = torch.tensor([-100.0, 100.0, 0.0])
    gate, up = both.split(shape[-1], dim=-1)
    got = step_ops_cpu.silu_mul(gate, up)
    assert got.shape == gate.shape and got.is_contiguous()
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-6, atol=1e-7)
    bf_gate, bf_up = gate.bfloat16(), up.bfloat16()
    got, want = step_ops_cpu.silu_mul(bf_gate, bf_up), F.silu(bf_gate) * bf_up
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0.0)  # within one bf16 step, and rarely off
    assert (got != want).float().mean() < 0.01


def test_rope_of_a_fused_projection_turns_bit_for_bit():
    rows, width, heads, kv_heads, dim = 3, 4, 8, 2, 64
    qkv = torch.randn(rows, width, (heads + 2 * kv_heads) * dim)
    both = qkv.as_strided((rows, width, heads + kv_heads, dim), qkv.stride()[:2] + (dim, 1))  # q and k, not v
    cos, sin = torch.randn(rows, width, dim), torch.randn(rows, width, dim)
    got = step_ops_cpu.rope(both, cos, sin)
    assert got.shape == both.shape and torch.equal(got, _turn(both, cos[..., None, :], sin[..., None, :]))
    packed, cos, sin = torch.randn(7, 4, 16), torch.randn(7, 16), torch.randn(7, 16)
    assert torch.equal(step_ops_cpu.rope(packed, cos, sin), _turn(packed, cos[:, None], sin[:, None]))


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, the row cast back before the weight."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 256), (3, 5, 256), (37, 64), (600, 256)])
def test_bf16_rms_norm_matches_transformers(shape):
    """bf16 (a draft head's): transformers' order of roundings; its fp32 sum runs in another order, so an
    element may round to the neighbouring bf16 value, and only rarely."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = (3 * torch.randn(shape, generator=generator)).bfloat16()
    weight = torch.randn(shape[-1], generator=generator).bfloat16()
    got, want = step_ops_cpu.rms_norm(x, weight, 1e-5), _hf_rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=2**-7, atol=0.0)  # within one bf16 step
    assert (got != want).float().mean() < 0.01
    strided = x.transpose(0, -2) if x.dim() == 3 else x[:, ::2]
    w = weight[: strided.shape[-1]]
    torch.testing.assert_close(step_ops_cpu.rms_norm(strided, w, 1e-5), _hf_rms_norm(strided, w, 1e-5),
                               rtol=2**-7, atol=0.0)


def test_bf16_rope_turns_bit_for_bit():
    """Each product and the sum rounded to bf16, as PyTorch's bf16 ops round them."""
    rows, width, heads, kv_heads, dim = 3, 4, 8, 2, 64
    qkv = torch.randn(rows, width, (heads + 2 * kv_heads) * dim).bfloat16()
    both = qkv.as_strided((rows, width, heads + kv_heads, dim), qkv.stride()[:2] + (dim, 1))
    cos, sin = torch.randn(rows, width, dim).bfloat16(), torch.randn(rows, width, dim).bfloat16()
    got = step_ops_cpu.rope(both, cos, sin)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _turn(both, cos[..., None, :], sin[..., None, :]))
    with pytest.raises(RuntimeError, match="x's dtype the tables'"):
        step_ops_cpu.rope(both, cos.float(), sin.float())


@pytest.mark.parametrize("rows, vocab", [(1, 4096), (8, 4096), (3, 37), (2, 8192), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_d2t", [False, True])
def test_greedy_pick_matches_the_reference(rows, vocab, dtype, with_d2t):
    """Peaked and flat rows, vocabularies with and without a tail past 16 lanes, bf16 logits, with and without
    EAGLE-3's d2t offsets, and rows of a wider tensor (a draft step's logits at its last query)."""
    generator = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=generator) * torch.linspace(0.5, 8, rows)[:, None]).to(dtype)
    d2t = torch.randint(0, 50, (vocab,), generator=generator) if with_d2t else None
    want_ids, want_probs = greedy_pick_reference(logits, d2t)
    for view in (logits, torch.stack([logits, logits.flip(0)], 1)[:, 0]):
        ids, probs = step_ops_cpu.greedy_pick(view, d2t)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(probs, want_probs, rtol=1e-5, atol=1e-7)


def test_greedy_pick_takes_the_first_of_a_tie_and_drafts_through_it(monkeypatch, ops_on):
    """The first index of the largest logit wins (torch.max's choice); a draft step's pick runs the op at
    inference, the reference where autograd records."""
    logits = torch.zeros(2, 3000)
    logits[0, [5, 2000]] = 3.0
    logits[1, [1500, 2999]] = 2.0
    assert step_ops_cpu.greedy_pick(logits, None)[0].tolist() == [5, 1500]
    calls = []
    real = step_ops_cpu.greedy_pick
    monkeypatch.setattr(step_ops_cpu, "greedy_pick", lambda *a: calls.append(a[0].shape) or real(*a))
    with torch.inference_mode():
        ids, probs = pick_greedy(logits)
    assert calls == [(2, 3000)] and ids.tolist() == [5, 1500]
    torch.testing.assert_close(probs, greedy_pick_reference(logits)[1])
    pick_greedy(logits.requires_grad_())
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="d2t is int64 offsets"):
        step_ops_cpu.greedy_pick(logits, torch.zeros(7, dtype=torch.long))


@pytest.mark.parametrize("shape", [(8, 5, 8192), (1, 4096), (3, 37), (2, 64), (5, 1000), (4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_torch_argmax(shape, dtype):
    """Random rows, rows of ties (bf16 rounds many values alike; a tie inside and across the four vectors a
    step and in the tail), a NaN (counted largest, as torch's) and strided rows: torch.argmax's ids."""
    generator = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(shape, generator=generator).to(dtype)
    flat = logits.view(-1, shape[-1])
    if shape[-1] >= 64:
        flat[0].fill_(1.0)
        flat[0, [7, 40, shape[-1] - 1]] = 3.0  # a three-way tie: the first wins
        flat[-1, [shape[-1] // 2, shape[-1] - 2]] = float("nan")
    assert torch.equal(step_ops_cpu.greedy_ids(logits), logits.argmax(-1))
    wide = torch.stack([logits, logits], -2)[..., 0, :]  # rows a stride apart
    assert torch.equal(step_ops_cpu.greedy_ids(wide), wide.argmax(-1))


def test_greedy_choices_of_tokens_go_through_the_op(monkeypatch, ops_on):
    """`argmax_ids` runs the op at inference and torch's argmax where autograd records; a parallel drafter's
    greedy block takes it."""
    from draftsmith.methods.draft_sampling import choose_block

    calls = []
    real = step_ops_cpu.greedy_ids
    monkeypatch.setattr(step_ops_cpu, "greedy_ids", lambda x: calls.append(tuple(x.shape)) or real(x))
    logits = torch.randn(3, 4, 300, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(step_ops_cpu.argmax_ids(logits), logits.argmax(-1))
        out = torch.full((3, 4), -7, dtype=torch.long)
        choose_block(logits, [4, 2, 0], torch.arange(3), None, {}, out, None)
        want = torch.where(torch.arange(4) < torch.tensor([4, 2, 0])[:, None], logits.argmax(-1), -1)
        assert torch.equal(out, want)
    assert calls == [(3, 4, 300)] * 2
    assert torch.equal(step_ops_cpu.argmax_ids(logits.requires_grad_()), logits.argmax(-1)) and len(calls) == 2


def test_kv_write_puts_each_query_at_its_slot_and_position():
    cache = torch.randn(5, 2, 50, 64)
    want = cache.clone()
    slots, positions = torch.tensor([[3, 3, 4], [1, 1, 1]]), torch.tensor([[7, 8, 0], [2, 3, 49]])
    new = torch.randn(2, 3, 2, 64).transpose(1, 2)  # [B, heads, Q, head_dim] as a projection leaves it
    step_ops_cpu.write_kv(cache, slots, positions, new)
    want[slots, :, positions] = new.transpose(1, 2)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="position past the cache"):
        step_ops_cpu.write_kv(cache, slots, positions + 1, new)
    with pytest.raises(RuntimeError, match="slot past the cache"):
        step_ops_cpu.write_kv(cache, slots + 2, positions, new)


def _counting(monkeypatch, name: str) -> list:
    calls, real = [], getattr(step_ops_cpu, name)
    monkeypatch.setattr(step_ops_cpu, name, lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def test_a_decoder_forward_takes_each_add_with_its_norm(monkeypatch, ops_on):
    """A target forward at inference runs every residual add with the norm after it and every MLP's activation
    through the ops, and computes what PyTorch's ops compute; under autograd it runs none of them."""
    adds, activations = _counting(monkeypatch, "add_rms_norm"), _counting(monkeypatch, "silu_mul")
    torch.manual_seed(0)
    model = CausalLM(TargetConfig.from_hf_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                                "intermediate_size": 48, "num_hidden_layers": 3,
                                                "num_attention_heads": 4, "num_key_value_heads": 2}))
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    reference = model(ids, feature_layers=(1, 2, 3))
    assert not adds and not activations
    with torch.inference_mode():
        out = model(ids, feature_layers=(1, 2, 3))
    assert len(adds) == 2 * 3 and len(activations) == 3
    torch.testing.assert_close(out.logits, reference.logits, rtol=1e-5, atol=1e-5)
    for layer in (1, 2, 3):
        torch.testing.assert_close(out.hidden_states[layer], reference.hidden_states[layer], rtol=1e-5, atol=1e-5)


def test_the_model_runs_them_at_inference_only(monkeypatch, ops_on):
    norms, turns, writes = (_counting(monkeypatch, name) for name in ("rms_norm", "rope", "write_kv"))
    norm, x = RMSNorm(32, 1e-6), torch.randn(2, 32, requires_grad=True)
    norm(x).sum().backward()  # training: PyTorch's ops, which autograd records
    assert not norms and x.grad is not None
    qkv = torch.randn(1, 2, 4 * 16)
    q, k = qkv[..., :32].view(1, 2, 2, 16), qkv[..., 32:48].view(1, 2, 1, 16)
    cos, sin = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    cache = KVCache(1, 2, 8, 1, 16, torch.float32, "cpu")
    batch = ForwardBatch.build([0], [3], [2], cache, None, "cpu")
    with torch.inference_mode():
        norm(x)
        apply_rope_qk(q, k, cos, sin)
        batch.write(cache.k[0], k.transpose(1, 2))
    assert norms and turns and writes
    assert torch.equal(cache.k[0][0, :, 3:5], k[0].transpose(0, 1))
    # a bf16 draft head's norms, turns and writes too
    bf16_cache = KVCache(1, 2, 8, 1, 16, torch.bfloat16, "cpu")
    calls = (len(norms), len(turns), len(writes))
    with torch.inference_mode():
        norm.bfloat16()(x.detach().bfloat16())
        apply_rope_qk(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
        batch.write(bf16_cache.k[0], k.transpose(1, 2).bfloat16())
    assert all(after > before for after, before in zip((len(norms), len(turns), len(writes)), calls))
    assert torch.equal(bf16_cache.k[0][0, :, 3:5], k[0].transpose(0, 1).bfloat16())


def test_turned_off_by_the_variable(monkeypatch, ops_on):
    norms = _counting(monkeypatch, "rms_norm")
    monkeypatch.setenv(step_ops_cpu.VARIABLE, "torch")
    step_ops_cpu._allowed.cache_clear()
    with torch.inference_mode():
        RMSNorm(8, 1e-6)(torch.randn(3, 8))
    assert not norms
    monkeypatch.setenv(step_ops_cpu.VARIABLE, "fast")
    step_ops_cpu._allowed.cache_clear()
    with torch.inference_mode(), pytest.raises(DraftsmithError, match="DRAFTSMITH_CPU_OPS='fast': one of auto"):
        step_ops_cpu.runs_for(torch.randn(2))


@pytest.mark.slow
def test_the_engine_decodes_alike_with_and_without_them(monkeypatch, ops_on, target, greedy_reference):
    """Plain decoding of the demo model with every norm, rope and KV write through the ops gives the ids it
    gives through PyTorch's, with n-gram drafts verified through them too."""
    from draftsmith.serve import LLM
    from helpers import DEMO_MODEL, greedy_token_ids, spec_config

    norms, writes = _counting(monkeypatch, "rms_norm"), _counting(monkeypatch, "write_kv")
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
              enforce_eager=True, speculative_config=spec_config("ngram", k=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert greedy_token_ids(llm) == greedy_reference
    assert norms and any(shape[2] > 1 for shape in writes)  # a verify forward wrote its drafts' keys
    monkeypatch.setattr(slot_attention_cpu, "LOADED", False)
    norms.clear()
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target,
                enforce_eager=True)
    assert greedy_token_ids(plain) == greedy_reference
    assert not norms


@pytest.mark.parametrize("rows,width,vocab,budget_rows", [(1, 7, 300, 512), (8, 7, 300, 16), (3, 5, 97, 4)])
def test_markov_chain_drafts_as_bias_rows_then_argmax(ops_on, rows, width, vocab, budget_rows):
    """The C++ greedy Markov chain (`MarkovBiasRows.greedy_chain`) drafts what adding each position's kept bias
    row and taking the argmax drafts, including when the budget makes it stop, fetch rows and evict."""
    from draftsmith.methods.dspark.markov_cache import MarkovBiasRows

    generator = torch.Generator().manual_seed(rows * width + vocab)
    w1, w2 = torch.randn(vocab, 8, generator=generator), torch.randn(vocab, 8, generator=generator)
    for trial in range(6):
        base = 3 * torch.randn(rows, width, vocab, generator=generator)
        base[0, 0, :3] = base[0, 0, :3].max() + 1  # a tie before the bias: the first index wins unless it moves
        last = torch.randint(0, vocab, (rows,), generator=generator)
        reference_rows = MarkovBiasRows(w1, w2, budget_bytes=budget_rows * vocab * 4)
        previous, expected = last, []
        logits = base.clone()
        for j in range(width):
            previous = reference_rows.add_to(logits[:, j], previous).argmax(-1)
            expected.append(previous)
        chained_rows = MarkovBiasRows(w1, w2, budget_bytes=budget_rows * vocab * 4)
        with torch.no_grad():  # the ops run where nothing records autograd
            got = chained_rows.greedy_chain(base, last)
        assert got is not None and torch.equal(got, torch.stack(expected, 1)), trial
        kept = chained_rows.row_of >= 0  # the tensor map agrees with the dict, evictions included
        assert sorted(kept.nonzero().flatten().tolist()) == sorted(chained_rows.where)
        assert all(chained_rows.row_of[t].item() == r for t, r in chained_rows.where.items())
