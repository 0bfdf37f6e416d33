"""The Triton slot attention kernel (on the GPU where there is one, else run by the interpreter on CPU) against
its PyTorch reference, and the reference against the engine's own attention over a ForwardBatch's mask: GQA up
to Llama-3-8B's 32/8 heads with head_dim 128, ragged rows in scattered slots, causal blocks, tree masks,
sliding windows, key ranges, split-K, fp32/fp16/bf16; the kernel's device rules."""


import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.models import slot_attention_triton as triton_kernel
from draftsmith.models.attention import cached_attention
from draftsmith.models.kv_cache import ForwardBatch, KVCache
from draftsmith.models.slot_attention_reference import slot_attention_reference
from helpers import KERNEL_DEVICE, spec_config, triton_kernel_marks

pytestmark = triton_kernel_marks(triton_kernel)


def _case(heads, kv_heads, dim, q_lens, starts, dtype, seed=0, slots_total=6, max_len=640):
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(q_lens), max(q_lens)
    k_cache = torch.randn(slots_total, kv_heads, max_len, dim, generator=generator).to(dtype).to(KERNEL_DEVICE)
    v_cache = torch.randn(slots_total, kv_heads, max_len, dim, generator=generator).to(dtype).to(KERNEL_DEVICE)
    q = torch.randn(rows, heads, width, dim, generator=generator).to(dtype).to(KERNEL_DEVICE)
    # scattered, not in order
    slots = torch.tensor([(3 * i + 1) % slots_total for i in range(rows)], device=KERNEL_DEVICE)
    positions = torch.tensor(starts, device=KERNEL_DEVICE)[:, None] + torch.arange(width, device=KERNEL_DEVICE)
    kv_lens = torch.tensor([s + n for s, n in zip(starts, q_lens)], device=KERNEL_DEVICE)
    return q, k_cache, v_cache, slots, positions, kv_lens


TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _check(got, want, dtype, q_lens):
    for b, n in enumerate(q_lens):  # padding queries past a row's own are not compared
        torch.testing.assert_close(got[b, :, :n].float(), want[b, :, :n].float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 8, 128), (8, 2, 64), (4, 4, 32)])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 2, 16]])
def test_causal_blocks_over_ragged_rows(heads, kv_heads, dim, q_lens):
    q, k, v, slots, positions, kv_lens = _case(heads, kv_heads, dim, q_lens, starts=[37, 300, 0][: len(q_lens)],
                                               dtype=torch.float32)
    got = triton_kernel.slot_attention(q, k, v, slots, positions, kv_lens)
    _check(got, slot_attention_reference(q, k, v, slots, positions, kv_lens), torch.float32, q_lens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes_split_k_and_key_ranges(dtype):
    q_lens, starts = [4, 1, 9], [500, 130, 61]
    q, k, v, slots, positions, kv_lens = _case(8, 2, 64, q_lens, starts, dtype, seed=1)
    key_starts = torch.tensor([100, 0, 60], device=KERNEL_DEVICE)
    want = slot_attention_reference(q, k, v, slots, positions, kv_lens, key_starts=key_starts)
    for splits in (1, 3, 7):  # split-K over 500 keys, uneven ranges, some splits empty for short rows
        got = triton_kernel.slot_attention(q, k, v, slots, positions, kv_lens, key_starts=key_starts,
                                           num_splits=splits)
        _check(got, want, dtype, q_lens)


@pytest.mark.slow
@pytest.mark.cuda
def test_tree_masks_and_sliding_windows():
    q_lens, starts = [7, 16], [90, 250]
    q, k, v, slots, positions, kv_lens = _case(32, 8, 128, q_lens, starts, torch.float32, seed=2)
    generator = torch.Generator().manual_seed(3)
    tree = torch.rand(2, 16, 16, generator=generator) < 0.4
    tree |= torch.eye(16, dtype=torch.bool)  # every node sees itself
    tree = tree.to(KERNEL_DEVICE)
    block_starts = torch.tensor(starts, device=KERNEL_DEVICE)
    want = slot_attention_reference(q, k, v, slots, positions, kv_lens, tree_mask=tree, block_starts=block_starts)
    got = triton_kernel.slot_attention(q, k, v, slots, positions, kv_lens, tree_mask=tree, block_starts=block_starts,
                                       num_splits=2)
    _check(got, want, torch.float32, q_lens)
    full = torch.ones_like(tree)  # DFlash: every block query sees the whole block
    causal = slot_attention_reference(q, k, v, slots, positions, kv_lens)
    non_causal = triton_kernel.slot_attention(q, k, v, slots, positions, kv_lens, tree_mask=full,
                                              block_starts=block_starts)
    assert not torch.allclose(non_causal[0, :, :6], causal[0, :, :6])  # the block's later keys were read
    _check(non_causal, slot_attention_reference(q, k, v, slots, positions, kv_lens, tree_mask=full,
                                                block_starts=block_starts), torch.float32, q_lens)
    windowed = triton_kernel.slot_attention(q, k, v, slots, positions, kv_lens, window=64)
    _check(windowed, slot_attention_reference(q, k, v, slots, positions, kv_lens, window=64), torch.float32, q_lens)


def test_the_reference_is_the_engines_attention_over_a_forward_batch():
    """The rules the kernel follows are the engine's: its ForwardBatch mask over gathered keys gives the same
    attention as the reference reading the slots in place, causal and with a sliding window."""
    cache = KVCache(1, 5, 400, 2, 64, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(4)
    cache.k[0].normal_(generator=generator)
    cache.v[0].normal_(generator=generator)
    slots, starts, q_lens = [4, 0, 2], [210, 33, 120], [3, 6, 1]
    q = torch.randn(3, 8, 6, 64, generator=generator)
    positions = torch.tensor(starts)[:, None] + torch.arange(6)
    kv_lens = torch.tensor([s + n for s, n in zip(starts, q_lens)])
    for window in (None, 50):
        batch = ForwardBatch.build(slots, starts, q_lens, cache, window)
        engine = cached_attention(q, batch.read(cache.k[0]), batch.read(cache.v[0]), batch.mask)
        want = slot_attention_reference(q, cache.k[0], cache.v[0], torch.tensor(slots), positions, kv_lens,
                                        window=window)
        _check(engine, want, torch.float32, q_lens)


@pytest.mark.slow
@pytest.mark.cuda
def test_the_engine_decodes_and_verifies_through_the_kernel(monkeypatch, kernel_target, kernel_greedy_reference):
    """DRAFTSMITH_ATTENTION=triton: every decode and verify forward of the demo model (eager steps, on
    KERNEL_DEVICE) attends through the kernel (prefill chunks wider than 16 queries keep PyTorch's); greedy
    n-gram speculation gives the plain engine's tokens."""
    from draftsmith.serve import LLM
    from helpers import DEMO_MODEL, greedy_token_ids

    calls = []
    real = triton_kernel.slot_attention
    monkeypatch.setattr(triton_kernel, "slot_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "triton")
    llm = LLM(DEMO_MODEL, dtype="float32", device=KERNEL_DEVICE, max_num_seqs=3, max_model_len=256,
              target=kernel_target, enforce_eager=True,
              speculative_config=spec_config("ngram", k=3, prompt_lookup_min=1, prompt_lookup_max=3))
    assert greedy_token_ids(llm) == kernel_greedy_reference
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    assert any(shape[2] > 1 for shape in calls)  # verify forwards (k + 1 queries a row) went through it


def test_a_bad_attention_choice_is_one_line(monkeypatch):
    from draftsmith.errors import DraftsmithError
    from draftsmith.models.kernel_backend import slot_kernel_wanted

    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "flash")
    with pytest.raises(DraftsmithError, match="DRAFTSMITH_ATTENTION='flash': one of auto, triton, torch"):
        slot_kernel_wanted("cpu")
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DraftsmithError, match="runs only under Triton's interpreter: set TRITON_INTERPRET=1"):
        slot_kernel_wanted("cpu")
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    assert slot_kernel_wanted("cpu") is False


def _decode_args(device):
    """A one-row decode's kernel arguments (q, caches, slots, positions, kv_lens) on `device`."""
    case = _case(4, 2, 32, [1], [10], torch.float32, slots_total=2, max_len=32)
    return [t.to(device) for t in case]


def test_kernel_tensors_are_on_cuda_or_under_the_interpreter(monkeypatch):
    """The kernel's device rules, each one line rather than a bad pointer inside Triton: its tensors share one
    device, and that is CUDA, or the CPU under Triton's interpreter alone."""
    args = _decode_args(KERNEL_DEVICE)
    args[3] = args[3].to("meta")  # the slots elsewhere than the rest
    with pytest.raises(DraftsmithError, match="slot_attention: slots is on meta but q on"):
        triton_kernel.slot_attention(*args)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DraftsmithError, match=r"slot_attention: q is on cpu: Triton kernels run on CUDA, or on CPU "
                                              r"only under Triton's interpreter \(TRITON_INTERPRET=1\)"):
        triton_kernel.slot_attention(*_decode_args("cpu"))
