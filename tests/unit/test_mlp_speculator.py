"""IBM MLP speculators: the stage math as TGI writes it, save/reload, and lossless serving of random and
converted public (tied, untied, scale_input) speculators on the demo model."""

import math

import pytest
import torch
import torch.nn.functional as F

import public_checkpoints as pub
from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head
from draftsmith.methods.mlp_speculator.head import MLPSpeculatorHead
from draftsmith.models.head_configs import MLPSpeculatorConfig
from draftsmith.serve import LLM, SamplingParams
from helpers import CODE_PROMPTS, DEMO_MODEL, spec_config


def _random(target, tied=False, scale_input=False, n=3, inner=192):
    torch.manual_seed(6)
    config = MLPSpeculatorConfig(emb_dim=256, inner_dim=inner, vocab_size=8192, n_predict=n, tie_weights=tied,
                                 scale_input=scale_input, target_model=str(DEMO_MODEL))
    head = MLPSpeculatorHead(config).attach_target(target)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.05)
    return head


@pytest.mark.parametrize("tied, scale_input", [(False, False), (True, True)])
def test_stages_compute_what_tgi_writes(tied, scale_input, target):
    """TGI's form: state_weight * proj(state) + emb_weight * emb(token), then the RMS-style norm with scale
    and shift (x rsqrt(mean x^2 + 1e-6) w + b), GELU, head; stages i >= 2 of a tied speculator reuse proj.1."""
    head = _random(target, tied, scale_input)
    n, inner = 3, 192
    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt((1 - state_weight**2) * inner / 2)
    hidden, tokens = torch.randn(4, 256), torch.randint(0, 8192, (4, n))
    state = hidden
    if scale_input:
        state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    expected = []
    for i in range(n):
        s = 0 if tied else i
        proj = head.proj[min(i, 1) if tied else i].weight
        mixed = state_weight * (state @ proj.T) + emb_weight * head.emb[s].weight[tokens[:, i]]
        normed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + 1e-6) * head.ln[s].weight + head.ln[s].bias
        state = F.gelu(normed)
        expected.append(state @ head.head[s].weight.T)
    torch.testing.assert_close(head(hidden, tokens), torch.stack(expected, 1), atol=2e-4, rtol=1e-4)


def test_saved_head_reloads_bit_exactly(target, tmp_path):
    head = _random(target, tied=True)
    head.save_pretrained(tmp_path)
    again = load_head(tmp_path)
    assert again.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("tied, scale_input", [(False, False), (True, True)])
def test_saved_speculators_round_trip_through_the_vllm_layout(tied, scale_input, target, tmp_path):
    head = _random(target, tied, scale_input)
    head.save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "vllm", "--to", "vllm") == 0
    assert pub.convert(tmp_path / "vllm", tmp_path / "back") == 0
    config, tensors = pub.read_native(tmp_path / "back")
    again = MLPSpeculatorConfig.from_json(config)
    assert (again.n_predict, again.inner_dim, again.tie_weights, again.scale_input) == (3, 192, tied, scale_input)
    assert tensors.keys() == head.state_dict().keys()
    assert all(torch.equal(tensors[k], v) for k, v in head.state_dict().items())


def _serve(head_dir, k=3):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
               speculative_config=spec_config("mlp_speculator", head_dir, k))


@pytest.mark.slow
def test_a_random_speculator_decodes_with_greedy_equality(target, tmp_path, greedy_reference):
    _random(target).save_pretrained(tmp_path)
    llm = _serve(tmp_path)  # 4 prompts, 3 slots: rows join and leave a mixed batch
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("build", [lambda d: pub.mlp_speculator(d), lambda d: pub.mlp_speculator(d, tied=True),
                                   lambda d: pub.mlp_speculator(d, tied=True, all_names=False, scale_input=True)])
def test_converted_public_speculators_decode_with_greedy_equality(build, tmp_path, greedy_reference):
    assert pub.convert(build(tmp_path / "src"), tmp_path / "head", "--target", DEMO_MODEL) == 0
    llm = _serve(tmp_path / "head")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_more_drafts_than_stages_is_a_clear_error(target, tmp_path):
    _random(target).save_pretrained(tmp_path)
    with pytest.raises(DraftsmithError, match=r"num_speculative_tokens=4, but the mlp_speculator head .* drafts at most 3"):
        _serve(tmp_path, k=4)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_training_on_a_tiny_target_lowers_the_loss(tied, tmp_path):
    import json

    from draftsmith.train.recipe import validate_recipe
    from draftsmith.train.trainer import train
    from helpers import make_tiny_target_with_tokenizer, tiny_recipe, write_code_corpus

    target_dir = make_tiny_target_with_tokenizer(tmp_path / "target")
    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(target_dir, data, tmp_path / "run", "mlp_speculator", epochs=3)
    raw["model"].update(n_predict=2, tie_weights=tied)  # the target's width: stage heads start as its LM head
    final = train(validate_recipe(raw), ["test"])
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    losses, agreement = [r["loss"] for r in log], [r["acc_stage0"] for r in log]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert sum(agreement[-5:]) / 5 > sum(agreement[:5]) / 5 + 0.1, agreement
    report = json.loads((tmp_path / "run" / "eval_epoch3.json").read_text())
    assert report["sim_mean_acceptance_length_k2"] >= report["sim_mean_acceptance_length_k1"] > 1.0
    head = load_head(final)
    assert head.config.n_predict == 2 and head.config.tie_weights == tied


def test_stage_one_learns_the_texts_own_tokens(target):
    """IBM's stage 1 (`labels: text`): stage i at t is scored by cross-entropy against the text's token t + 2 + i,
    counted where that token exists and carries loss, written out here position by position."""
    from types import SimpleNamespace

    from draftsmith.methods.mlp_speculator.objective import mlp_speculator_objective

    head = _random(target, n=2)
    with torch.no_grad():  # each stage predicts one token whatever it reads: half the labels below are it
        for norm in head.ln:
            norm.weight.zero_()
        liked = [int(stage(norm.bias[None])[0].argmax()) for stage, norm in zip(head.head, head.ln)]
    ids = torch.tensor(liked + [7])[torch.randint(0, 3, (2, 9))]
    loss_mask = torch.ones(2, 9, dtype=torch.long)
    loss_mask[1, 7:] = 0  # the second row is padded after 7 tokens
    last = target(ids, feature_layers=(6,)).hidden_states[6]
    cfg = SimpleNamespace(labels="text", stage_decay=0.5)
    total, logs = mlp_speculator_objective(head, target, {"input_ids": ids, "loss_mask": loss_mask}, {"last": last}, cfg)
    width = 9 - 2
    logits = head(last[:, :width], torch.stack([ids[:, 1 + i : 1 + i + width] for i in range(2)], dim=-1))
    expected = 0.0
    for i in range(2):
        counted = [(b, t) for b in range(2) for t in range(width)
                   if t + 2 + i < 9 and loss_mask[b, t + 2 + i] and loss_mask[b, t + 1 + i]]
        terms = [F.cross_entropy(logits[b, t, i], ids[b, t + 2 + i]) for b, t in counted]
        expected += 0.5**i * torch.stack(terms).mean()
        hits = [int(logits[b, t, i].argmax() == ids[b, t + 2 + i]) for b, t in counted]
        assert 0 < sum(hits) < len(hits)
        assert logs[f"acc_stage{i}"] == pytest.approx(sum(hits) / len(hits))  # the same positions, scored top-1
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)
