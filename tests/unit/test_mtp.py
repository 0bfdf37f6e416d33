"""MTP heads: the layer's computation, save/reload, export (as MiMo's layout) and re-import, training on a tiny
target, and lossless serving of random, trained and converted heads."""

import json

import pytest
import torch
from safetensors.torch import load_file

import public_checkpoints as pub
from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head, resolve_method
from draftsmith.methods.mtp.head import MTPHead
from draftsmith.methods.mtp.objective import step_weights
from draftsmith.models import load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import train
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    REPO,
    make_tiny_target_with_tokenizer,
    spec_config,
    tiny_recipe,
    write_code_corpus,
)

SHIPPED = REPO / "assets" / "demo-code-7m-mtp"


def _demo_config() -> dict:
    return json.loads((DEMO_MODEL / "config.json").read_text())


def _random_head(target, directory=None, seed=4, model_type="llama"):
    torch.manual_seed(seed)
    source = {**_demo_config(), "model_type": model_type}
    head = MTPHead.for_target(target.config, source, str(DEMO_MODEL)).attach_target(target)
    with torch.no_grad():
        for param in head.parameters():
            param.normal_(1.0 if param.dim() == 1 else 0.0, 0.05)  # norms near 1, matrices small
    if directory is not None:
        head.save_pretrained(directory)
    return head


def _serve(head_dir, k=3, max_num_seqs=3, **keys):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=max_num_seqs, max_model_len=256,
               speculative_config=spec_config("mtp", head_dir, k, **keys))


@pytest.mark.parametrize("layout, order", [("mimo", "hidden_first"), ("deepseek", "embedding_first")])
def test_step_is_norms_projection_block_then_the_target_readout(layout, order, target):
    """Written out with the target's own last layer as the block (the head starts as its copy): the layer
    order, the concatenation order, the residual, the embedding zeroed at position 0 and which state is fed
    back (MiMo's layer returns its normed output, DeepSeek's the block's), as vLLM computes them."""
    head = _random_head(target)
    head.config.layout, head.config.concat_order = layout, order
    head.init_from_target()
    layer = head.layers[0]
    ids, hidden = torch.randint(0, 8192, (2, 7)), torch.randn(2, 7, 256)
    positions = torch.arange(7).expand(2, 7)
    out, logits = head.step(ids, hidden, positions, from_target=True)
    emb = target.model.embed_tokens(ids)
    emb[:, 0] = 0
    emb, h = layer.token_norm(emb), layer.hidden_norm(hidden)
    x = layer.input_proj(torch.cat([h, emb] if order == "hidden_first" else [emb, h], dim=-1))
    cos, sin = head.rope(positions, x.dtype)
    block_out = target.model.layers[-1](x, cos, sin, None, None)
    torch.testing.assert_close(out, layer.final_norm(block_out) if layout == "mimo" else block_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, target.lm_head(layer.final_norm(block_out)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_saved_head_reloads_bit_exactly_and_round_trips_through_vllm_as_mimo(model_type, target, tmp_path, capsys):
    """A Llama block gains zero q/k/v biases in MiMo's layout and loses them again; a Qwen2 block has them.
    vLLM cannot serve either beside a target that is not MiMo, and the export says so."""
    head = _random_head(target, directory=tmp_path / "native", model_type=model_type)
    again = load_head(tmp_path / "native")
    assert again.config == head.config
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))
    capsys.readouterr()
    assert pub.convert(tmp_path / "native", tmp_path / "vllm", "--to", "vllm") == 0
    assert f"note: vLLM cannot serve this export beside a {model_type} target" in capsys.readouterr().out
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    # what vLLM's mimo_mtp reads: MiMo's config and names, a Qwen2 block whose q/k/v biases are zero
    assert (exported["model_type"], exported["architectures"], exported["num_nextn_predict_layers"]) == \
        ("mimo", ["MiMoForCausalLM"], 1)
    tensors = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert torch.equal(tensors["model.mtp_layers.0.input_proj.weight"], head.layers[0].input_proj.weight)
    bias = tensors["model.mtp_layers.0.self_attn.k_proj.bias"]
    assert torch.equal(bias, head.layers[0].block.self_attn.k_proj.bias) if model_type == "qwen2" else not bias.any()
    assert pub.convert(tmp_path / "vllm", tmp_path / "back") == 0
    config, back = pub.read_native(tmp_path / "back")
    native_config, _ = pub.read_native(tmp_path / "native")
    assert {k: v for k, v in config.items() if k != "target_model"} == \
        {k: v for k, v in native_config.items() if k != "target_model"}
    assert back.keys() == head.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in head.state_dict().items())


@pytest.mark.slow
def test_random_head_decodes_with_greedy_equality(target, tmp_path, greedy_reference):
    _random_head(target, directory=tmp_path / "head")
    llm = _serve(tmp_path / "head")  # 4 prompts, 3 slots: rows join and leave a mixed batch
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not SHIPPED.is_dir(), reason="assets/demo-code-7m-mtp is not in this checkout")
def test_shipped_demo_head_decodes_with_greedy_equality_and_accepts(greedy_reference):
    llm = _serve(SHIPPED, k=4)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    metrics = llm.get_metrics()
    # a random layer accepts next to nothing; the shipped one 2.1 tokens a step here (EAGLE-3's head: 2.7)
    assert metrics["mean_acceptance_length"] > 1.8


@pytest.mark.slow
@pytest.mark.parametrize("mtp_layers", [1, 2])
def test_converted_mimo_layers_decode_with_greedy_equality(mtp_layers, tmp_path, greedy_reference):
    """A MiMo checkpoint's MTP layers (Qwen2 blocks, with q/k/v biases) shaped like the demo model; with two,
    layer 0 drafts every step, as vLLM's v1 proposer does."""
    src = pub.mimo_mtp_for(DEMO_MODEL, tmp_path / "src", mtp_layers)
    assert pub.convert(src, tmp_path / "head", "--target", DEMO_MODEL) == 0
    head = load_head(tmp_path / "head")
    assert len(head.layers) == mtp_layers and head.layers[0].block.self_attn.q_proj.bias is not None
    llm = _serve(tmp_path / "head")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


def test_fastmtp_step_weights():
    assert [round(w, 2) for w in step_weights(3, 0.6)] == [0.51, 0.31, 0.18]  # training.md's figures


@pytest.mark.slow
def test_training_on_a_tiny_target_lowers_the_loss_and_serves(tmp_path):
    target_dir = make_tiny_target_with_tokenizer(tmp_path / "target")
    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(target_dir, data, tmp_path / "run", "mtp", epochs=3, ttt_length=2)
    final = train(validate_recipe(raw), ["test"])
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    losses, agreement = [r["loss"] for r in log], [r["acc_step1"] for r in log]
    assert sum(losses[-5:]) < sum(losses[:5]), losses
    assert sum(agreement[-5:]) / 5 > sum(agreement[:5]) / 5 + 0.1, agreement  # the recursive step learns too
    report = json.loads((tmp_path / "run" / "eval_epoch3.json").read_text())
    assert report["sim_mean_acceptance_length_k2"] >= report["sim_mean_acceptance_length_k1"] > 1.0
    head = load_head(final)
    assert head.head_type == "mtp" and head.config.source_config["model_type"] == "llama"
    tiny = load_target(target_dir, dtype="float32")
    assert resolve_method("mtp").default_feature_layers(tiny.config.num_hidden_layers) == head.attach_target(tiny).feature_layers


def test_a_head_for_another_target_shape_is_refused(tmp_path):
    target_dir = make_tiny_target_with_tokenizer(tmp_path / "target")
    tiny = load_target(target_dir, dtype="float32")
    head = MTPHead.for_target(tiny.config, json.loads((target_dir / "config.json").read_text()))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(DraftsmithError, match="MTP hidden size"):
        _serve(tmp_path / "head")


def test_a_qwen3_block_does_not_export_as_mimo(tmp_path, capsys):
    """MiMo's layer is a Qwen2 block: a layer with q/k norms would load in vLLM without them, so it is refused."""
    target = load_target(DEMO_MODEL, dtype="float32")
    head = MTPHead.for_target(target.config, {**_demo_config(), "model_type": "qwen3"})
    assert head.layers[0].block.self_attn.q_norm is not None
    head.save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "vllm", "--to", "vllm") == 2
    assert "vLLM has no MTP model for this qwen3 block (q/k norms)" in capsys.readouterr().err
