"""EAGLE / EAGLE-3 heads: save/reload, serving (cache) path == training (TTT) path, greedy equality."""

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head, resolve_method
from draftsmith.methods.eagle.training import unroll
from draftsmith.methods.heads import draft_dtype, pack_draft_weights
from draftsmith.models import DraftHeadConfig, ForwardBatch
from draftsmith.serve import LLM, SamplingParams
from helpers import DEMO_MODEL, REPO, spec_config

AUX = {"eagle": (6,), "eagle3": (1, 3, 5)}


def _random_head(kind, target, tmp_path=None):
    torch.manual_seed(1)
    config = DraftHeadConfig.for_target(kind, target.config, AUX[kind], 1024 if kind == "eagle3" else None, "demo")
    head = resolve_method(kind).head_module(config).attach_target(target)
    if kind == "eagle3":
        head.set_vocab(torch.arange(0, 2048, 2))
    if tmp_path is not None:
        head.save_pretrained(tmp_path)
    return head


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_saved_head_reloads_bit_exactly(kind, target, tmp_path):
    head = _random_head(kind, target, tmp_path)
    again = load_head(tmp_path).attach_target(target)
    assert head.config == again.config
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert "embed_tokens" not in str(list(again.state_dict()))  # shared with the target, not stored
    if kind == "eagle3":
        ids = torch.tensor([0, 5, 511])
        assert again.to_target_ids(ids).tolist() == [0, 10, 1022]
        assert again.t2d.sum() == 1024


def test_head_rejects_a_different_target(target, tmp_path):
    _random_head("eagle3", target, tmp_path)
    config = target.config.__class__(**{**target.config.__dict__, "hidden_size": 512})
    other = type("T", (), {"config": config})()
    with pytest.raises(DraftsmithError, match="hidden size 256, but the target has 512"):
        load_head(tmp_path).attach_target(other)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_cached_drafting_matches_training_time_test(kind, target):
    """Catching up on a prefix through the cache, then drafting 3 steps, equals TTT steps 0..3 at that spot."""
    head = _random_head(kind, target)
    ids = torch.randint(0, 8192, (1, 20))
    feats = head.features(target(ids, feature_layers=head.feature_layers).hidden_states)
    ttt = [logits for _, logits in unroll(head, ids, feats, 4)]
    p = 12  # last verified position: the head has seen features 0..p with tokens 1..p+1
    cache = head.make_cache(2, 64)
    batch = ForwardBatch.build([1], [0], [p + 1], cache)
    with torch.no_grad():
        out, logits = head.step(ids[:, 1 : p + 2], feats[:, : p + 1], batch.positions, True, cache, batch)
        torch.testing.assert_close(logits[0, p], ttt[0][0, p], atol=1e-4, rtol=0)
        state = out[:, p : p + 1]
        for s in range(1, 4):  # feed teacher-forced tokens, as TTT does, at positions p + s
            batch = ForwardBatch.build([1], [p + s], [1], cache)
            state, logits = head.step(ids[:, p + 1 + s : p + 2 + s], state, batch.positions, False, cache, batch)
            torch.testing.assert_close(logits[0, 0], ttt[s][0, p], atol=1e-4, rtol=0)


PROMPTS = ["def add(a, b):\n    return a", "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa",
           "for i in ra", "class A:\n    def __init__(self):\n        self.x = 1\n        self.y"]


@pytest.fixture(scope="module")
def greedy_reference():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40),
                                                           use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("requested", ["float32", "bfloat16", "auto"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_greedy_equality_with_random_head(kind, requested, target, tmp_path, greedy_reference):
    """Lossless whatever the head drafts, in the target's dtype or another (a bfloat16 head under a float32
    target: EAGLE-1 reads out through the target's float32 LM head), or over weights packed in bfloat16."""
    _random_head(kind, target, tmp_path)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              # fixed k: a random head's drafts are rarely accepted, so the adaptive policy may stop drafting
              speculative_config=spec_config(kind, tmp_path, 3, draft_dtype=requested))
    expected = draft_dtype(requested, torch.float32, torch.device("cpu"))
    assert {p.dtype for p in llm.engine.proposer.head.parameters()} == {expected}
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert llm.engine.proposer.pending.ring.dtype == expected  # target features are kept in the head's dtype


@pytest.mark.slow
def test_a_bfloat16_head_drafts_as_well_as_a_float32_one(greedy_reference):
    """The shipped EAGLE-3 head in bfloat16 (half the bytes read per draft step), or over weights packed in
    bfloat16 ("auto" on a CPU that runs the panel GEMM), keeps its acceptance."""
    lengths = {}
    for dtype in ("float32", "bfloat16", "auto"):
        llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
                  speculative_config=spec_config("eagle3", REPO / "assets" / "demo-code-7m-eagle3", 3, draft_dtype=dtype))
        got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == greedy_reference
        lengths[dtype] = llm.get_metrics()["mean_acceptance_length"]
    assert lengths["float32"] > 2.0 and abs(lengths["bfloat16"] - lengths["float32"]) < 0.15, lengths
    assert abs(lengths["auto"] - lengths["float32"]) < 0.15, lengths


def test_auto_packs_a_heads_own_layers_in_bfloat16(target):
    """Under "auto" on a CPU running the panel GEMM, a float32 head's own layers read bfloat16 weights, and
    EAGLE-1, which reads out through the target's LM head, through a packed copy of it; the target's own
    layers, its LM head included, stay float32; an explicit float32 packs nothing."""
    from draftsmith.models import linear
    if not linear.panels_run(torch.float32):
        pytest.skip("fp32 layers do not run the panel GEMM here (no AVX-512 or no C++ build): nothing to pack")
    head = _random_head("eagle", target)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        exact = head.readout(x)
    assert pack_draft_weights("float32", [head], target) == 0
    # fc, the layer's q, k, v, o, gate, up and down, and the read-out copy
    assert pack_draft_weights("auto", [head], target) == 1 + 7 + 1
    packed = [m for m in head.modules() if m.__dict__.get("panel_dtype") == torch.bfloat16]
    assert head.fc in packed and not any("panel_dtype" in m.__dict__ for m in target.modules())
    with torch.inference_mode():
        read = head.readout(x)
        assert torch.equal(target.lm_head(x), exact)  # the target reads its own, unpacked
    rounded = torch.ops.draftsmith_cpu.pack_panels(target.lm_head.weight.detach().bfloat16())
    assert torch.equal(read, torch.ops.draftsmith_cpu.panel_linear(x, rounded, None, 8192))


def test_auto_draft_dtype(monkeypatch):
    """"auto" keeps a half-precision target's dtype and an explicit choice wins; under a float32 target it
    drafts in bfloat16 only where the device multiplies bfloat16 fast (on a CPU: where oneDNN runs it) and,
    on a CPU, fp32 layers do not run the panel GEMM (where they do, float32 drafts faster)."""
    from draftsmith.methods import heads

    cpu = torch.device("cpu")
    assert draft_dtype("auto", torch.float16, cpu) == torch.float16
    assert draft_dtype("float32", torch.float32, cpu) == torch.float32
    fast = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    monkeypatch.setattr(heads, "panels_run", lambda dtype: False)
    assert draft_dtype("auto", torch.float32, cpu) == (torch.bfloat16 if fast else torch.float32)
    assert draft_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    monkeypatch.setattr(heads, "panels_run", lambda dtype: dtype == torch.float32)
    assert draft_dtype("auto", torch.float32, cpu) == torch.float32
    assert draft_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16


def test_method_and_head_must_agree(target, tmp_path):
    _random_head("eagle", target, tmp_path)
    with pytest.raises(DraftsmithError, match="holds an 'eagle' head but the speculative config says method 'eagle3'"):
        LLM(DEMO_MODEL, speculative_config={"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(DraftsmithError, match="needs \"model\""):
        LLM(DEMO_MODEL, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
