"""The EAGLE-3 variants current trainers write (speculators 0.9's defaults, SpecForge's fc_norm, Qwen3-style
layers, sliding windows): imported, served losslessly, exported back, computed as speculators computes them."""

import json

import pytest
import torch

import public_checkpoints as pub
import speculators_oracle as oracle
from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head, resolve_method
from draftsmith.methods.eagle.training import unroll
from draftsmith.models import DraftHeadConfig, ForwardBatch
from draftsmith.serve import LLM, SamplingParams
from helpers import CODE_PROMPTS, DEMO_MODEL, spec_config

VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "qk_norm", "sliding_window")


def _serves_losslessly(head_dir, greedy_reference) -> None:
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              # fixed k: random heads, which the adaptive policy may rightly stop drafting with
              speculative_config=spec_config("eagle3", head_dir, 3))
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def _flags(config: dict) -> dict:
    return {name: config[name] for name in VARIANT_FLAGS}


# -- import and serve, whatever is installed -------------------------------------------------------------------

NONE = dict.fromkeys(VARIANT_FLAGS, False) | {"sliding_window": None}
CHECKPOINTS = {
    # what speculators 0.9 trains by default: refused with "input_norm.weight are not part of ..." before
    "speculators defaults": (lambda d: pub.speculators_default(d, verifier=str(DEMO_MODEL)),
                             NONE | {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True,
                                     "sliding_window": 2048}),
    "Qwen3 layer, fc_norm, a window the prompts outgrow": (
        lambda d: pub.speculators_eagle3(d, verifier=str(DEMO_MODEL), qwen3=True, fc_norm=True, sliding_window=8),
        NONE | {"qk_norm": True, "fc_norm": True, "sliding_window": 8}),
    "SpecForge 3.1 (fc_norm under its older aux_norm names)": (
        lambda d: pub.specforge_eagle3_1(d), NONE | {"fc_norm": True}),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_variant_checkpoints_import_and_serve_losslessly(name, tmp_path, greedy_reference, capsys):
    build, flags = CHECKPOINTS[name]
    target = () if name.startswith(("speculators", "Qwen3")) else ("--target", DEMO_MODEL)  # their verifier is here
    assert pub.convert(build(tmp_path / "src"), tmp_path / "head", *target) == 0
    assert "EAGLE-3 variant" in capsys.readouterr().out or flags == NONE
    config, _ = pub.read_native(tmp_path / "head")
    assert _flags(config) == flags
    _serves_losslessly(tmp_path / "head", greedy_reference)


def test_specforge_norm_output_means_what_specforge_trains(tmp_path, capsys):
    """SpecForge's norm_output=true (its default) puts the final norm before the LM head and feeds the pre-norm
    state back: the plain EAGLE-3 computation, not speculators' norm_output."""
    assert pub.convert(pub.specforge_eagle3_1(tmp_path / "src"), tmp_path / "head", "--target", DEMO_MODEL) == 0
    assert "norm_output=true read as SpecForge trains it" in capsys.readouterr().out
    assert pub.read_native(tmp_path / "head")[0]["norm_output"] is False


def test_window_keys_in_a_specforge_config_are_not_a_window(tmp_path, capsys):
    """SpecForge configs copy the target's window keys; its Llama draft attends without a window, and vLLM and
    SGLang serve the layout so: kept as full attention, with a note."""
    src = pub.specforge_eagle3(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    window = {"sliding_window": 64, "use_sliding_window": True, "layer_types": ["sliding_attention"]}
    (src / "config.json").write_text(json.dumps({**config, **window}))
    assert pub.convert(src, tmp_path / "head", "--target", DEMO_MODEL) == 0
    assert "ignored the config's sliding window (64)" in capsys.readouterr().out
    assert pub.read_native(tmp_path / "head")[0]["sliding_window"] is None


@pytest.mark.parametrize("name", ["speculators defaults", "Qwen3 layer, fc_norm, a window the prompts outgrow"])
def test_variants_round_trip_through_speculators(name, tmp_path):
    build, _ = CHECKPOINTS[name]
    assert pub.convert(build(tmp_path / "src"), tmp_path / "native") == 0
    assert pub.convert(tmp_path / "native", tmp_path / "speculators", "--to", "speculators") == 0
    assert pub.convert(tmp_path / "speculators", tmp_path / "again") == 0
    first, again = pub.read_native(tmp_path / "native"), pub.read_native(tmp_path / "again")
    assert _flags(again[0]) == _flags(first[0])
    assert first[1].keys() == again[1].keys()
    assert all(torch.equal(first[1][k], again[1][k]) for k in first[1])


def test_engine_exports_refuse_variants_the_engine_does_not_compute(tmp_path, capsys):
    assert pub.convert(CHECKPOINTS["speculators defaults"][0](tmp_path / "src"), tmp_path / "native") == 0
    assert pub.convert(tmp_path / "native", tmp_path / "sglang", "--to", "sglang") == 2
    assert "SGLang's llama_eagle3 does not compute norm_before_residual, norm_before_fc" in capsys.readouterr().err
    assert pub.convert(tmp_path / "native", tmp_path / "vllm", "--to", "vllm") == 0
    said = capsys.readouterr().out
    assert "older vLLM releases ignore these flags" in said and "sliding window 2048: needs vLLM 0.32" in said
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["norm_before_residual"] and exported["norm_before_fc"] and exported["norm_output"]
    # vLLM's draft layers slide where `layer_types` says so, draft-relative (llama.py LlamaAttention)
    assert exported["sliding_window"] == 2048 and exported["layer_types"] == ["sliding_attention"]
    assert pub.convert(tmp_path / "vllm", tmp_path / "back") == 0  # our own export: norm_output as vLLM means it
    back = pub.read_native(tmp_path / "back")[0]
    assert back["norm_output"] is True and back["sliding_window"] == 2048
    assert pub.convert(CHECKPOINTS["Qwen3 layer, fc_norm, a window the prompts outgrow"][0](tmp_path / "qwen3"),
                       tmp_path / "qwen3-native") == 0
    assert pub.convert(tmp_path / "qwen3-native", tmp_path / "qwen3-vllm", "--to", "vllm") == 2
    assert "vLLM's llama_eagle3 does not compute qk_norm" in capsys.readouterr().err


# -- the head itself -------------------------------------------------------------------------------------------

def _variant_head(target, **variants):
    torch.manual_seed(3)
    config = DraftHeadConfig.for_target("eagle3", target.config, (1, 3, 5), 1024, "demo", **variants)
    head = resolve_method("eagle3").head_module(config).attach_target(target)
    head.set_vocab(torch.arange(0, 2048, 2))
    with torch.no_grad():  # norms away from 1, so that each shows in the output
        for name, param in head.named_parameters():
            if name.endswith("norm.weight") or ".norm." in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape))
    return head


@pytest.mark.parametrize("variants", [
    {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True, "sliding_window": 5},
    {"fc_norm": True, "qk_norm": True, "sliding_window": 3},
    {"norm_before_residual": True, "qk_norm": True, "sliding_window": 4, "num_hidden_layers": 2},
])
def test_cached_drafting_matches_training_time_test_for_variants(variants, target):
    """The serving path (the head's cache) computes what training computes (causal or windowed attention,
    diagonal TTT keys), with a window shorter than the prefix: the catch-up slides the window by position,
    and draft steps read from W before the first draft on, as speculators' training mask has them. That rule
    is the one the proposer's `_step_batches` applies (test_eagle_proposer's windowed test checks it there).
    A stacked head's layers each read their own cache layer, as each has its own TTT history."""
    head = _variant_head(target, **variants)
    ids = torch.randint(0, 8192, (1, 20))
    feats = head.features(target(ids, feature_layers=head.feature_layers).hidden_states)
    ttt = [logits for _, logits in unroll(head, ids, feats, 4)]
    p, window = 12, variants["sliding_window"]
    cache = head.make_cache(2, 64)
    batch = ForwardBatch.build([1], [0], [p + 1], cache, window)
    with torch.no_grad():
        out, logits = head.step(ids[:, 1 : p + 2], feats[:, : p + 1], batch.positions, True, cache, batch)
        torch.testing.assert_close(logits[0, p], ttt[0][0, p], atol=1e-4, rtol=0)
        state = out[:, p : p + 1]
        for s in range(1, 4):
            batch = ForwardBatch.build([1], [p + s], [1], cache, key_starts=[p + 1 - window])
            state, logits = head.step(ids[:, p + 1 + s : p + 2 + s], state, batch.positions, False, cache, batch)
            torch.testing.assert_close(logits[0, 0], ttt[s][0, p], atol=1e-4, rtol=0)


def test_variant_flags_change_the_computation(target):
    """Each flag is computed, not just carried: flipping it alone changes the logits."""
    ids = torch.randint(0, 8192, (1, 12))
    base = _variant_head(target)
    feats = base.features(target(ids, feature_layers=base.feature_layers).hidden_states)
    reference = [logits for _, logits in unroll(base, ids, feats, 2)][-1]
    for variants in [{"norm_before_residual": True}, {"norm_before_fc": True}, {"fc_norm": True},
                     {"norm_output": True}, {"qk_norm": True}, {"sliding_window": 2}]:
        head = _variant_head(target, **variants)
        shared = {k: v for k, v in base.state_dict().items() if k in head.state_dict()}
        head.load_state_dict(shared, strict=False)  # same weights; the variant's own norms stay non-trivial
        logits = [logits for _, logits in unroll(head, ids, feats, 2)][-1]
        assert not torch.allclose(logits, reference, atol=1e-4), variants


def test_an_eagle1_window_trains_as_it_serves(target):
    """EAGLE-1's one variant, a window: the objective's forward (no cache: the layer's causal window mask) and
    the serving catch-up (a windowed ForwardBatch over the head's cache) give the same logits at every
    position; the window changes them once the prefix outgrows it, and only then."""
    from dataclasses import replace

    torch.manual_seed(0)
    config = DraftHeadConfig.for_target("eagle", target.config, (6,), None, "demo", sliding_window=4)
    head = resolve_method("eagle").head_module(config).attach_target(target)
    whole = resolve_method("eagle").head_module(replace(config, sliding_window=None)).attach_target(target)
    whole.load_state_dict(head.state_dict())
    ids = torch.randint(0, 8192, (1, 16))
    feats = head.features(target(ids, feature_layers=head.feature_layers).hidden_states)
    n = ids.shape[1] - 1
    with torch.no_grad():
        _, trained = head.step(ids[:, 1:], feats[:, :n], torch.arange(n)[None], True)
        _, unwindowed = whole.step(ids[:, 1:], feats[:, :n], torch.arange(n)[None], True)
        cache = head.make_cache(2, 64)
        batch = ForwardBatch.build([1], [0], [n], cache, 4)
        _, served = head.step(ids[:, 1:], feats[:, :n], batch.positions, True, cache, batch)
    torch.testing.assert_close(served, trained, atol=1e-4, rtol=0)
    torch.testing.assert_close(unwindowed[:, :4], trained[:, :4], atol=1e-5, rtol=0)
    assert not torch.allclose(unwindowed[:, 4:], trained[:, 4:], atol=1e-3)


def test_eagle1_heads_refuse_eagle3_variants(target):
    config = DraftHeadConfig.for_target("eagle", target.config, (6,), None, "demo", norm_output=True, sliding_window=8)
    with pytest.raises(DraftsmithError, match="eagle heads have no variant norm_output$"):
        resolve_method("eagle").head_module(config)
    with pytest.raises(DraftsmithError, match="exclude each other"):
        DraftHeadConfig.for_target("eagle3", target.config, (1, 3, 5), None, "demo", norm_before_fc=True, fc_norm=True)


def test_saved_variant_heads_reload_exactly(target, tmp_path):
    head = _variant_head(target, norm_before_fc=True, qk_norm=True, norm_output=True, sliding_window=64)
    head.save_pretrained(tmp_path)
    again = load_head(tmp_path).attach_target(target)
    assert again.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


# -- speculators itself as the oracle ----------------------------------------------------------------------------

ORACLE_CASES = {
    "defaults": {},  # norm_before_residual, norm_before_fc, norm_output, window 2048
    "Qwen3 layer, fc_norm, window 4": {"draft_arch": "qwen3", "fc_norm": True, "norm_before_fc": False,
                                       "sliding_window": 4},
    "flags off, trained embedding, window 6": {"norm_before_residual": False, "norm_before_fc": False,
                                               "norm_output": False, "embed_requires_grad": True, "sliding_window": 6},
    "three layers": {"num_layers": 3},  # the first reads [emb; hidden], two Llama layers after it
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ORACLE_CASES)
def test_speculators_checkpoints_import_and_draft_as_speculators_does(case, target, tmp_path, greedy_reference):
    """Heads saved by speculators' own trainer code (its default flags, or the case's) convert without --target,
    compute the logits speculators' forward computes at every TTT step, and serve losslessly."""
    oracle.trained_head(tmp_path / "theirs", DEMO_MODEL, **ORACLE_CASES[case])
    theirs, missing, unexpected = oracle.load(tmp_path / "theirs")
    assert pub.convert(tmp_path / "theirs", tmp_path / "ours") == 0
    ours = load_head(tmp_path / "ours").attach_target(target)
    torch.manual_seed(0)
    ids = torch.randint(0, 8192, (1, 17))
    feats = ours.features(target(ids, feature_layers=ours.feature_layers).hidden_states)
    expected = oracle.logits_by_step(theirs, ids[:, 1:], feats[:, :16], 4)
    for step, logits in unroll(ours, ids, feats, 4):
        torch.testing.assert_close(logits, expected[step], atol=2e-5, rtol=0)
    _serves_losslessly(tmp_path / "ours", greedy_reference)


@pytest.mark.parametrize("case", ["defaults", "Qwen3 layer, fc_norm, window 4", "three layers"])
def test_our_exports_load_in_speculators_and_compute_the_same(case, target, tmp_path):
    """A native head exported --to speculators loads with from_pretrained (no key missing or left over) and its
    forward agrees with ours."""
    oracle.trained_head(tmp_path / "theirs", DEMO_MODEL, **ORACLE_CASES[case])
    assert pub.convert(tmp_path / "theirs", tmp_path / "native") == 0
    assert pub.convert(tmp_path / "native", tmp_path / "export", "--to", "speculators") == 0
    theirs, missing, unexpected = oracle.load(tmp_path / "export")
    assert (missing, unexpected) == ([], [])
    assert all(torch.isfinite(p).all() for p in theirs.parameters())  # speculators marks unloaded weights NaN
    ours = load_head(tmp_path / "native").attach_target(target)
    ids = torch.randint(0, 8192, (1, 17))
    feats = ours.features(target(ids, feature_layers=ours.feature_layers).hidden_states)
    expected = oracle.logits_by_step(theirs, ids[:, 1:], feats[:, :16], 3)
    for step, logits in unroll(ours, ids, feats, 3):
        torch.testing.assert_close(logits, expected[step], atol=2e-5, rtol=0)


def test_stacked_heads_whose_layers_differ_are_named(target, tmp_path, capsys):
    """Every layer of a stacked head computes alike: a later layer lacking the q/k norms the first one has, or
    a Qwen config whose layers slide from layer 1 on, is one line at conversion."""
    from safetensors.torch import save_file

    _variant_head(target, qk_norm=True, num_hidden_layers=2).save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "spec", "--to", "speculators") == 0
    tensors = pub.source_tensors(tmp_path / "spec")
    del tensors["layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(tmp_path / "spec" / "model.safetensors"))
    assert pub.convert(tmp_path / "spec", tmp_path / "back", "--target", DEMO_MODEL) == 2
    assert "layer 1 holds self_attn.k_norm.weight, the first layer self_attn.k_norm.weight, " \
           "self_attn.q_norm.weight" in capsys.readouterr().err
    _variant_head(target, num_hidden_layers=2).save_pretrained(tmp_path / "plain")
    assert pub.convert(tmp_path / "plain", tmp_path / "vllm", "--to", "vllm") == 0
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    (tmp_path / "vllm" / "config.json").write_text(json.dumps(config))
    assert pub.convert(tmp_path / "vllm", tmp_path / "back2", "--target", DEMO_MODEL) == 2
    assert "the draft layers mix attention types (layers from 1 on slide)" in capsys.readouterr().err
