"""P-EAGLE (issue #42): an EAGLE-3 head whose drafts 2..k come from slots of the ptd token with the learned
`mask_hidden`, in the same forward as draft 1. Served drafts are what training's unroll teaches, decoding
stays lossless in one draft forward a step, and the export carries what vLLM's parallel drafting reads."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods import resolve_method
from draftsmith.methods.eagle.training import unroll
from draftsmith.models import DraftHeadConfig, load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config
from draftsmith.train.objectives import target_features
from helpers import CODE_PROMPTS, DEMO_MODEL, Row, recorded_draft_forwards, spec_config

K = 4


@pytest.fixture(scope="module")
def demo_target():
    return load_target(DEMO_MODEL, dtype="float32")


def _head(target, seed=0, parallel=True, layers=1, window=None):
    from draftsmith.methods.eagle3.head import Eagle3Head

    extra = {"parallel_drafting": True, "ptd_token_id": 3} if parallel else {}
    config = DraftHeadConfig.for_target("eagle3", target.config, (1, 3, 5), None, str(DEMO_MODEL),
                                        num_hidden_layers=layers, sliding_window=window, **extra)
    torch.manual_seed(seed)
    head = Eagle3Head(config).attach_target(target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            torch.nn.init.normal_(p, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.1)
        head.lm_head.weight.copy_(target.lm_head.weight)
    return head.eval()


def _serve(head_dir, k=K, **extra):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
               speculative_config=spec_config("eagle3", head_dir, k, draft_dtype="float32", parallel_drafting=True,
                                              **extra))


@pytest.mark.parametrize("layers,window", [(1, None), (2, None), (1, 6), (2, 6)])
def test_served_drafts_are_the_unrolled_steps(demo_target, tmp_path, layers, window):
    """One catch-up forward with k - 1 slots appended drafts what training's unroll gives at the last
    position: step 0 from the context, steps 1.. from the slots; in a stacked head, each layer's cache
    serves what its training-time-test history taught. With a window shorter than the context, each slot
    reads the newest W positions up to its own, as training's windows for the slots hold."""
    head = _head(demo_target, layers=layers, window=window)
    head.save_pretrained(tmp_path / "head")
    config = parse_speculative_config({"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": K,
                                       "draft_dtype": "float32", "parallel_drafting": True})
    proposer = resolve_method("eagle3").proposer_class()(config, demo_target, 2, 128)
    head = proposer.head
    ids = torch.randint(4, 8000, (1, 21))
    feats = target_features(demo_target, head.feature_layers, ids, "float32")
    rows = [Row("a", 0, ids[0, :20].tolist(), [int(ids[0, 20])])]
    proposer.observe(rows, [0], [20], feats["features"][:, :20])
    drafted = proposer.propose(rows, [K])
    with torch.no_grad():
        taught = [logits[0, 19] for _, logits in unroll(head, ids, feats["features"], K)]
    expected = [int(head.to_target_ids(step.argmax(-1))) for step in taught]
    assert drafted.tokens[0].tolist() == expected
    assert drafted.forwards == 1 and proposer.per_token_drafts is False


@pytest.mark.parametrize("limits", [(K, K), (K, 2)])
def test_rows_of_unequal_context_draft_in_one_forward_as_each_alone(demo_target, tmp_path, limits):
    """Rows holding different numbers of new positions (their slots placed after each row's own) and rows
    drafting fewer than k: each row's drafts are what training's unroll gives at its own last position, up to
    its limit, -1 after."""
    _head(demo_target).save_pretrained(tmp_path / "head")
    config = parse_speculative_config({"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": K,
                                       "draft_dtype": "float32", "parallel_drafting": True})
    proposer = resolve_method("eagle3").proposer_class()(config, demo_target, 2, 128)
    head, lengths = proposer.head, (20, 14)
    ids = [torch.randint(4, 8000, (1, n + 1)) for n in lengths]
    feats = [target_features(demo_target, head.feature_layers, x, "float32")["features"] for x in ids]
    rows = [Row(name, slot, x[0, :n].tolist(), [int(x[0, n])]) for name, slot, x, n in zip("ab", (1, 0), ids, lengths)]
    padded = torch.zeros(2, max(lengths), feats[0].shape[-1])
    for b, (f, n) in enumerate(zip(feats, lengths)):
        padded[b, :n] = f[0, :n]
    proposer.observe(rows, [0, 0], list(lengths), padded)
    drafted = proposer.propose(rows, list(limits))
    for b, (x, f, n, limit) in enumerate(zip(ids, feats, lengths, limits)):
        with torch.no_grad():
            taught = [logits[0, n - 1] for _, logits in unroll(head, x, f, K)]
        expected = [int(head.to_target_ids(step.argmax(-1))) for step in taught][:limit]
        assert drafted.tokens[b].tolist() == expected + [-1] * (K - limit), b


@pytest.mark.parametrize("layers", [1, 3])
def test_greedy_equality_one_draft_forward_a_step(demo_target, tmp_path, greedy_reference, layers):
    _head(demo_target, seed=1, layers=layers).save_pretrained(tmp_path / "head")
    llm = _serve(tmp_path / "head")
    forwards = recorded_draft_forwards(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0 and set(forwards) == {1}


def test_parallel_drafting_needs_a_head_trained_for_it(demo_target, tmp_path):
    _head(demo_target, parallel=False).save_pretrained(tmp_path / "sequential")
    with pytest.raises(DraftsmithError, match="is a sequential EAGLE-3 head"):
        _serve(tmp_path / "sequential")
    with pytest.raises(DraftsmithError, match="parallel_drafting drafts a chain in one forward"):
        parse_speculative_config({"method": "eagle3", "model": "x", "num_speculative_tokens": 4,
                                  "parallel_drafting": True, "tree_depth": 2, "tree_top_k": 2})


@pytest.mark.parametrize("to", ["vllm", "speculators"])
@pytest.mark.parametrize("layers", [1, 2])
def test_round_trips_keep_the_shared_hidden_state(demo_target, tmp_path, to, layers):
    """The vLLM export carries mask_hidden and ptd_token_id (what its parallel drafting reads); speculators'
    is its peagle type; both read back to the same head, a stacked one with every layer."""
    import public_checkpoints as pub

    head = _head(demo_target, seed=2, layers=layers)
    head.save_pretrained(tmp_path / "native")
    config, tensors = pub.read_native(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / to, "--to", to) == 0
    exported = json.loads((tmp_path / to / "config.json").read_text())
    if to == "vllm":  # a full draft vocabulary: no d2t/t2d, which vLLM would have nowhere to load
        assert exported["ptd_token_id"] == 3
        assert {"d2t", "t2d"}.isdisjoint(pub.source_tensors(tmp_path / to)) and "mask_hidden" in tensors
    else:
        assert exported["speculators_model_type"] == "peagle" and exported["mask_token_id"] == 3
    assert pub.convert(tmp_path / to, tmp_path / "back", "--target", str(DEMO_MODEL)) == 0
    config_back, tensors_back = pub.read_native(tmp_path / "back")
    assert config_back["parallel_drafting"] is True and config_back["ptd_token_id"] == 3
    assert config_back["num_hidden_layers"] == layers
    assert tensors_back.keys() == tensors.keys()
    assert all(torch.equal(tensors_back[name], tensors[name]) for name in tensors)


@pytest.mark.slow
def test_training_teaches_the_slots_and_continues_a_sequential_head(tmp_path):
    """On the demo target and a regular corpus: the parallel slot's drafts (TTT step 1) agree more with the
    target as the loss falls (trained at anchors), and a sequential EAGLE-3 head continued under parallel_drafting with a second
    layer keeps its weights (the new layer, copied from the target's last, starts as the identity) and gains a
    mask_hidden."""
    from draftsmith.methods import load_head
    from draftsmith.train.recipe import validate_recipe
    from draftsmith.train.trainer import train
    from helpers import tiny_recipe, write_code_corpus

    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(DEMO_MODEL, data, tmp_path / "seq", "eagle3", epochs=1)
    raw["model"].update(aux_layer_ids=[1, 3, 5])
    train(validate_recipe(raw), ["test"])
    raw = tiny_recipe(DEMO_MODEL, data, tmp_path / "par", "eagle3", epochs=3, learning_rate=3e-3)
    raw["model"].update(aux_layer_ids=[1, 3, 5], parallel_drafting=True, ptd_token_id=3, num_draft_layers=2,
                        init_from=str(tmp_path / "seq" / "head"), layers_from_target=True)
    raw["training"]["num_anchors"] = 16  # the slots train at 16 positions a sequence
    final = train(validate_recipe(raw), ["test"])
    log = [json.loads(line) for line in (tmp_path / "par" / "train_log.jsonl").read_text().splitlines()]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(log[-5:], "loss") < mean(log[:5], "loss")
    assert mean(log[-5:], "acc_step1") > mean(log[:5], "acc_step1") + 0.1, [r["acc_step1"] for r in log]
    head = load_head(final)
    assert head.config.parallel_drafting and head.config.ptd_token_id == 3 and head.mask_hidden.shape == (1, 1, 768)
    assert head.config.num_hidden_layers == 2 and head.layers["1"].mlp.down_proj.weight.abs().sum() > 0
    first = json.loads((tmp_path / "par" / "train_log.jsonl").read_text().splitlines()[0])
    assert first["acc_step0"] > 0.2  # step 0 drafted as the sequential head did from the first batch


def test_sglang_export_is_refused_in_one_line(demo_target, tmp_path, capsys):
    import public_checkpoints as pub

    _head(demo_target).save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "sglang", "--to", "sglang") != 0
    assert "SGLang's EAGLE-3 worker does not" in capsys.readouterr().err


def test_bench_rows_name_parallel_drafting():
    from draftsmith.serve.bench.matrix import row_name

    assert row_name({"method": "eagle3", "parallel_drafting": True}) == "peagle"
    assert row_name({"method": "draft_model", "parallel_drafting": True}) == "pard"
    assert row_name({"method": "eagle3"}) == "eagle3"


def test_check_measures_a_parallel_head_drafting_in_parallel(tmp_path):
    from draftsmith.serve.check.cli import _spec

    assert _spec("eagle3", tmp_path, 5, {"parallel_drafting": True, "ptd_token_id": 3})["parallel_drafting"] is True
    assert "parallel_drafting" not in _spec("eagle3", tmp_path, 5, {})


def test_a_head_grown_by_a_layer_drafts_as_before_until_trained(demo_target):
    """`init_from` a one-layer head with `num_draft_layers: 2` (and parallel_drafting): the new layer starts as
    the identity, so every TTT step's logits are the saved head's; a recipe asking for fewer layers than the
    saved head has is one line."""
    from draftsmith.methods.eagle3 import Eagle3Method, Eagle3Recipe

    saved = _head(demo_target, seed=3)
    section = Eagle3Recipe(target=str(DEMO_MODEL), head_type="eagle3", parallel_drafting=True, ptd_token_id=3,
                           num_draft_layers=2, sliding_window=64)
    grown = Eagle3Method.continue_head(saved, section, demo_target).attach_target(demo_target).eval()
    assert grown.config.num_hidden_layers == 2 and list(grown.layers) == ["1"]
    assert grown.config.sliding_window == 64 and grown.layers["1"].self_attn.window == 64
    assert grown.make_cache(2, 16).k.__len__() == 2
    ids = torch.randint(4, 8000, (1, 12))
    feats = target_features(demo_target, saved.feature_layers, ids, "float32")["features"]
    with torch.no_grad():
        before = [logits for _, logits in unroll(saved, ids, feats, 3)]
        after = [logits for _, logits in unroll(grown, ids, feats, 3)]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)
    assert grown.layers["1"].self_attn.q_proj.weight.abs().sum() > 0  # only its output projections start at 0
    silent = Eagle3Recipe(target=str(DEMO_MODEL), head_type="eagle3")  # keys left out keep the saved head's
    assert Eagle3Method.continue_head(grown, silent, demo_target) is grown
    with pytest.raises(DraftsmithError, match="more than model.num_draft_layers 1"):
        Eagle3Method.continue_head(grown, Eagle3Recipe(target=str(DEMO_MODEL), head_type="eagle3",
                                                       num_draft_layers=1), demo_target)


def test_layers_from_target_start_as_the_targets_last_layers(demo_target):
    """`layers_from_target`: a new head's later layers are copies of the target's last ones; grown onto a saved
    head, the same copies with their output projections at zero, so that every TTT step drafts as before."""
    from draftsmith.methods.eagle3 import Eagle3Method, Eagle3Recipe

    def same_as_target(layer, theirs, outputs_zero):
        for name, value in theirs.state_dict().items():
            expected = torch.zeros_like(value) if outputs_zero and name.endswith(("o_proj.weight", "down_proj.weight")) \
                else value.float()
            torch.testing.assert_close(layer.state_dict()[name], expected, msg=name)

    section = Eagle3Recipe(target=str(DEMO_MODEL), head_type="eagle3", aux_layer_ids=[1, 3, 5], num_draft_layers=3,
                           draft_vocab_size=4096, layers_from_target=True)
    records = [{"input_ids": list(range(4, 200)), "loss_mask": [1] * 196}]
    fresh = Eagle3Method.build_head(section, demo_target, (1, 3, 5), records)
    for name, theirs in zip(["1", "2"], demo_target.model.layers[-2:]):
        same_as_target(fresh.layers[name], theirs, outputs_zero=False)

    saved = _head(demo_target, seed=5)
    grown = Eagle3Method.continue_head(saved, section.model_copy(update={"draft_vocab_size": None}), demo_target)
    grown = grown.attach_target(demo_target).eval()
    for name, theirs in zip(["1", "2"], demo_target.model.layers[-2:]):
        same_as_target(grown.layers[name], theirs, outputs_zero=True)
    ids = torch.randint(4, 8000, (1, 12))
    feats = target_features(demo_target, saved.feature_layers, ids, "float32")["features"]
    with torch.no_grad():
        for (_, before), (_, after) in zip(unroll(saved, ids, feats, 3), unroll(grown, ids, feats, 3)):
            torch.testing.assert_close(before, after)

    narrow = section.model_copy(update={"intermediate_size": 512})
    with pytest.raises(DraftsmithError, match="does not fit the EAGLE-3 head.s.*drop model.layers_from_target"):
        Eagle3Method.build_head(narrow, demo_target, (1, 3, 5), records)


def test_sglang_refuses_a_stacked_head_in_one_line(demo_target, tmp_path, capsys):
    import public_checkpoints as pub

    _head(demo_target, parallel=False, layers=2).save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "sglang", "--to", "sglang") != 0
    assert "SGLang's llama_eagle3 builds one decoder layer" in capsys.readouterr().err


@pytest.mark.slow
def test_a_four_layer_head_saved_by_speculators_peagle_serves_as_it_computes(demo_target, tmp_path, greedy_reference):
    """speculators' own P-EAGLE model (four layers, as P-EAGLE's published heads; its trained embedding) saved
    by its save_pretrained converts to a parallel-drafting head of four layers with its mask_hidden and slot
    token; its first draft's logits are speculators' EAGLE-3 forward's, and it decodes losslessly drafting in
    one forward a step."""
    import public_checkpoints as pub
    import speculators_oracle as oracle
    from draftsmith.methods import load_head

    oracle.trained_head(tmp_path / "theirs", DEMO_MODEL, peagle=True, num_layers=4)
    theirs, missing, unexpected = oracle.load(tmp_path / "theirs", peagle=True)
    assert (missing, unexpected) == ([], [])
    assert pub.convert(tmp_path / "theirs", tmp_path / "ours") == 0
    ours = load_head(tmp_path / "ours").attach_target(demo_target)
    c = ours.config
    assert (c.parallel_drafting, c.ptd_token_id, c.num_hidden_layers, c.own_embedding) == (True, 3, 4, True)
    assert torch.equal(ours.mask_hidden.flatten(), theirs.mask_hidden.flatten())
    ids = torch.randint(4, 8000, (1, 17))
    feats = target_features(demo_target, ours.feature_layers, ids, "float32")["features"]
    from speculators.models.eagle3 import Eagle3DraftModel

    # its EAGLE-3 forward over the same modules: step 0 is what P-EAGLE's anchor position computes
    expected = oracle.logits_by_step(theirs, ids[:, 1:], feats[:, :16], 1, partial(Eagle3DraftModel.forward, theirs))
    with torch.no_grad():
        _, logits = next(unroll(ours, ids, feats, 1))
    torch.testing.assert_close(logits, expected[0], atol=2e-5, rtol=0)
    llm = _serve(tmp_path / "ours")
    forwards = recorded_draft_forwards(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0 and set(forwards) == {1}
