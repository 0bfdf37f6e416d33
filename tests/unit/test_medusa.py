"""Medusa heads: the head's computation, save/reload, export and re-import, training on a tiny target, and
lossless serving of random, trained and converted public heads."""

import pytest
import torch

import public_checkpoints as pub
from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head, resolve_method
from draftsmith.methods.medusa.head import MedusaHead
from draftsmith.models import load_target
from draftsmith.models.head_configs import MedusaConfig
from draftsmith.serve import LLM, SamplingParams
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import train
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    make_speculation_pay,
    make_tiny_target_with_tokenizer,
    spec_config,
    tiny_recipe,
    write_code_corpus,
)


def _random_head(target, own_lm_heads=True, heads=3, layers=2, directory=None):
    torch.manual_seed(4)
    config = MedusaConfig(hidden_size=256, vocab_size=8192, num_heads=heads, num_layers=layers,
                          own_lm_heads=own_lm_heads, target_model=str(DEMO_MODEL))
    head = MedusaHead(config).attach_target(target)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(0, 0.05)
    if directory is not None:
        head.save_pretrained(directory)
    return head


def _serve(head_dir, k=3, max_num_seqs=3):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, max_model_len=256,
               speculative_config=spec_config("medusa", head_dir, k))


def test_each_head_is_resblocks_then_its_lm_head(target):
    """Head i: x + SiLU(W x + b), num_layers times, then its LM head (or the target's), written out here."""
    for own in (True, False):
        head = _random_head(target, own_lm_heads=own)
        x = torch.randn(5, 256)
        got = head(x)
        assert got.shape == (5, 3, 8192)
        for i in range(3):
            h = x
            for layer in head.blocks[i].layers:
                h = h + torch.nn.functional.silu(h @ layer.weight.T + layer.bias)
            readout = head.lm_heads[i].weight if own else target.lm_head.weight
            torch.testing.assert_close(got[:, i], h @ readout.T, atol=1e-4, rtol=0)


def test_heads_reading_out_through_the_target_share_one_lm_head_call(target):
    """Heads without LM heads of their own run the target's once over their stacked outputs, at inference bit
    for bit what a call per head gives (each row's logits are one chain of sums whatever the rows beside it)."""
    head = _random_head(target, own_lm_heads=False)
    calls = []
    hook = target.lm_head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    x = torch.randn(2, 256)
    try:
        with torch.inference_mode():
            got = head(x)
            alone = [target.lm_head(head.blocks[i](x)) for i in range(3)]
    finally:
        hook.remove()
    assert calls[0] == (2, 3, 256) and len(calls) == 1 + 3
    for i in range(3):
        assert torch.equal(got[:, i], alone[i])


def test_saved_head_reloads_bit_exactly_and_round_trips_through_vllm(target, tmp_path):
    head = _random_head(target, directory=tmp_path / "native")
    again = load_head(tmp_path / "native")
    assert again.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    assert pub.convert(tmp_path / "native", tmp_path / "vllm", "--to", "vllm") == 0
    assert pub.convert(tmp_path / "vllm", tmp_path / "back") == 0
    config, tensors = pub.read_native(tmp_path / "back")
    assert config["num_heads"] == 3 and config["num_layers"] == 2
    assert all(torch.equal(tensors[k], v) for k, v in head.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("own_lm_heads", [True, False])
def test_random_heads_decode_with_greedy_equality(own_lm_heads, target, tmp_path, greedy_reference):
    _random_head(target, own_lm_heads=own_lm_heads, directory=tmp_path / "head")
    llm = _serve(tmp_path / "head")  # 4 prompts, 3 slots: rows join and leave a mixed batch
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_each_draft_is_priced_as_one_more_head(target, tmp_path):
    """The heads run in one pass, but each draft runs one more head (its block and its own LM head): the
    cost model must price drafting 1 token below drafting 3."""
    _random_head(target, directory=tmp_path / "head")
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256,
              speculative_config=spec_config("medusa", tmp_path / "head", 3, adaptive=True))
    make_speculation_pay(llm)
    seen, propose = [], llm.engine.proposer.propose

    def recording(rows, widths, *args, **kwargs):
        drafts = propose(rows, widths, *args, **kwargs)
        seen.append((max(widths), drafts.forwards))
        return drafts

    llm.engine.proposer.propose = recording
    llm.generate(CODE_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert seen and all(width == forwards for width, forwards in seen), seen
    cost = llm.engine.policy.cost
    assert cost.per_token_drafts and cost.drafting(1, 1) < cost.drafting(1, 3)


@pytest.mark.slow
@pytest.mark.parametrize("build", [
    lambda d: pub.medusa(d, heads=3, layers=1), lambda d: pub.medusa(d, heads=4, layers=2, weights="medusa_lm_head.safetensors"),
    lambda d: pub.medusa(d, lm_heads=False)])
def test_converted_public_heads_decode_with_greedy_equality(build, tmp_path, greedy_reference):
    assert pub.convert(build(tmp_path / "src"), tmp_path / "head", "--target", DEMO_MODEL) == 0
    llm = _serve(tmp_path / "head")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_more_drafts_than_heads_is_a_clear_error(target, tmp_path):
    _random_head(target, directory=tmp_path / "head")
    with pytest.raises(DraftsmithError, match=r"num_speculative_tokens=4, but the medusa head .* drafts at most 3 tokens a step"):
        _serve(tmp_path / "head", k=4)


def test_a_head_that_copies_the_target_drafts_what_the_target_says_next(target, tmp_path):
    """Medusa's own initialization (ResBlocks the identity, LM heads the target's) makes every head predict
    what the target's own LM head predicts at t (token t + 1): training starts from the target's readout."""
    head = MedusaHead(MedusaConfig(hidden_size=256, vocab_size=8192, num_heads=2, num_layers=1)).attach_target(target)
    head.init_from_target()
    ids = torch.randint(0, 8192, (1, 12))
    last = head.features(target(ids, feature_layers=head.feature_layers).hidden_states)
    assert torch.equal(head(last).argmax(-1)[..., 0], target(ids).logits.argmax(-1))


@pytest.mark.slow
def test_training_on_a_tiny_target_lowers_the_loss_and_serves(tmp_path):
    target_dir = make_tiny_target_with_tokenizer(tmp_path / "target")
    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(target_dir, data, tmp_path / "run", "medusa", epochs=3)
    raw["model"].update(num_heads=2)
    final = train(validate_recipe(raw), ["test"])
    import json

    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    losses, agreement = [r["loss"] for r in log], [r["acc_head0"] for r in log]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert sum(agreement[-5:]) / 5 > sum(agreement[:5]) / 5 + 0.1, agreement
    report = json.loads((tmp_path / "run" / "eval_epoch3.json").read_text())
    assert report["sim_mean_acceptance_length_k2"] >= report["sim_mean_acceptance_length_k1"] > 1.0
    head = load_head(final)
    assert head.head_type == "medusa" and head.config.num_heads == 2
    tiny = load_target(target_dir, dtype="float32")
    assert resolve_method("medusa").default_feature_layers(tiny.config.num_hidden_layers) == head.attach_target(tiny).feature_layers
