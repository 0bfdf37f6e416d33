"""`draftsmith convert` for MLP speculators, Medusa heads and MTP layers: detection, exact tensor mapping,
written configs, round trips, validation, and reading only the MTP shards of a sharded target."""

import json

import pytest
import torch
from safetensors.torch import load_file

import public_checkpoints as pub
from draftsmith.convert.cli import run  # noqa: F401  (registers every format)
from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.registry import detect_source
from helpers import DEMO_MODEL

convert, native, source_tensors = pub.convert, pub.read_native, pub.source_tensors


def assert_round_trip(tmp_path, to):
    config, tensors = native(tmp_path / "native")
    assert convert(tmp_path / "native", tmp_path / to, "--to", to) == 0
    assert convert(tmp_path / to, tmp_path / "back") == 0
    config_back, tensors_back = native(tmp_path / "back")
    assert config_back == config and tensors_back.keys() == tensors.keys()
    assert all(torch.equal(tensors[k].view(torch.uint8) if tensors[k].dtype == torch.float8_e4m3fn else tensors[k],
                           tensors_back[k].view(torch.uint8) if tensors_back[k].dtype == torch.float8_e4m3fn else tensors_back[k])
               and tensors[k].dtype == tensors_back[k].dtype for k in tensors)


@pytest.mark.parametrize("build, expected", [
    (pub.mlp_speculator, "mlp_speculator"), (pub.medusa, "medusa"), (pub.deepseek_target_with_mtp, "mtp"),
    (pub.qwen3_next_target_with_mtp, "mtp"), (pub.mimo_target_with_mtp, "mtp"),
])
def test_detection(build, expected, tmp_path):
    assert detect_source(SourceCheckpoint(build(tmp_path / "src"))).name == expected


# -- MLP speculator ---------------------------------------------------------------------------------------------

def test_mlp_speculator_strips_the_prefix(tmp_path, capsys):
    src = pub.mlp_speculator(tmp_path / "src", scale_input=True)
    assert convert(src, tmp_path / "native", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "native")
    original = source_tensors(src)
    assert tensors.keys() == {k.removeprefix("speculator.") for k in original}
    assert all(torch.equal(tensors[k.removeprefix("speculator.")], v) for k, v in original.items())
    assert config == {"draftsmith_head_type": "mlp_speculator", "emb_dim": 256, "inner_dim": 192, "vocab_size": 8192,
                      "n_predict": 3, "tie_weights": False, "scale_input": True, "top_k_tokens_per_head": [5, 4, 3],
                      "n_candidates": 5, "target_model": str(DEMO_MODEL)}
    capsys.readouterr()
    assert_round_trip(tmp_path, "vllm")
    assert "note: vLLM cannot serve this export: its V1 engine" in capsys.readouterr().out  # vLLM 0.32 refuses it
    exported = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    assert "speculator.ln.2.bias" in exported


@pytest.mark.parametrize("all_names", [True, False])
def test_tied_mlp_speculator_keeps_the_shared_tensors(all_names, tmp_path):
    src = pub.mlp_speculator(tmp_path / "src", n_predict=3, tied=True, all_names=all_names)
    assert convert(src, tmp_path / "native") == 0
    config, tensors = native(tmp_path / "native")
    assert config["tie_weights"] is True
    assert sorted(tensors) == ["emb.0.weight", "head.0.weight", "ln.0.bias", "ln.0.weight", "proj.0.weight", "proj.1.weight"]
    original = source_tensors(src)
    assert torch.equal(tensors["proj.1.weight"], original["speculator.proj.1.weight"])
    assert_round_trip(tmp_path, "vllm")


def test_tied_duplicates_must_match(tmp_path, capsys):
    src = pub.mlp_speculator(tmp_path / "src", tied=True)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["speculator.head.2.weight"] += 1
    from safetensors.torch import save_file
    save_file(tensors, str(src / "model.safetensors"))
    assert convert(src, tmp_path / "out") == 2
    assert "speculator.head.2.weight differs from speculator.head.0.weight" in capsys.readouterr().err


def test_mlp_speculator_vocab_checked_against_target(tmp_path, capsys):
    src = pub.mlp_speculator(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    for name in list(tensors):
        if name.split(".")[1] in ("emb", "head"):
            tensors[name] = tensors[name][:4096]
    from safetensors.torch import save_file
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "vocab size 4096, but the target has 8192" in capsys.readouterr().err


# -- Medusa -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, weights", [(1, "medusa_lm_head.pt"), (2, "medusa_lm_head.safetensors")])
def test_medusa_counts_heads_from_the_keys(layers, weights, tmp_path, capsys):
    src = pub.medusa(tmp_path / "src", heads=3, layers=layers, weights=weights)
    assert convert(src, tmp_path / "native", "--target", DEMO_MODEL) == 0
    assert "config says 5 heads; the weights hold 3" in capsys.readouterr().out
    config, tensors = native(tmp_path / "native")
    assert (config["num_heads"], config["num_layers"], config["own_lm_heads"]) == (3, layers, True)
    original = source_tensors(src)
    for h in range(3):
        for j in range(layers):
            assert torch.equal(tensors[f"blocks.{h}.layers.{j}.weight"], original[f"{h}.{j}.linear.weight"])
            assert torch.equal(tensors[f"blocks.{h}.layers.{j}.bias"], original[f"{h}.{j}.linear.bias"])
        assert torch.equal(tensors[f"lm_heads.{h}.weight"], original[f"{h}.{layers}.weight"])
    assert len(tensors) == len(original)
    assert_round_trip(tmp_path, "vllm")
    vllm = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert (vllm["num_heads"], vllm["num_hidden_layers"], vllm["original_lm_head"]) == (3, layers, False)


def test_medusa2_without_lm_heads_takes_the_vocab_from_the_target(tmp_path, capsys):
    src = pub.medusa(tmp_path / "src", lm_heads=False)
    assert convert(src, tmp_path / "x") == 2
    assert "pass --target" in capsys.readouterr().err
    assert convert(src, tmp_path / "native", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "native")
    assert config["own_lm_heads"] is False and config["vocab_size"] == 8192
    assert not any(k.startswith("lm_heads.") for k in tensors)


def test_the_acceptance_record_goes_with_every_conversion(tmp_path, capsys):
    shipped = DEMO_MODEL.with_name("demo-code-7m-medusa")
    assert convert(shipped, tmp_path / "vllm", "--to", "vllm") == 0
    assert "acceptance record (acceptance.json) goes with it" in capsys.readouterr().out
    assert convert(tmp_path / "vllm", tmp_path / "back") == 0
    assert (tmp_path / "back" / "acceptance.json").read_text() == (shipped / "acceptance.json").read_text()


def test_medusa_on_the_target_lm_head_exports_it_for_vllm(tmp_path, capsys):
    """vLLM fills its own LM head of `original_lm_head` Medusa only from lm_heads.0.weight: without it, vLLM's
    stays uninitialised and accepts nothing. The export copies the target's (tied: its embedding) there."""
    src = pub.medusa(tmp_path / "src", lm_heads=False)
    assert convert(src, tmp_path / "native", "--target", DEMO_MODEL) == 0
    assert_round_trip(tmp_path, "vllm")  # read back, the copy is dropped again
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    exported = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    embedding = load_file(str(DEMO_MODEL / "model.safetensors"))["model.embed_tokens.weight"]
    assert config["original_lm_head"] is True and torch.equal(exported["lm_heads.0.weight"], embedding)
    assert not any(k.startswith("lm_heads.") and k != "lm_heads.0.weight" for k in exported)

    native_config = tmp_path / "native" / "config.json"
    native_config.write_text(json.dumps({**json.loads(native_config.read_text()), "target_model": "nowhere/model"}))
    capsys.readouterr()
    assert convert(tmp_path / "native", tmp_path / "vllm2", "--to", "vllm") == 2
    err = capsys.readouterr().err
    assert "lm_heads.0.weight" in err and "pass --target" in err and len(err.strip().splitlines()) == 1


def test_mtp_layers_of_a_kind_the_runtime_lacks_say_so(tmp_path):
    """DeepSeek-V3's MTP block is MLA attention over MoE experts: converted, exported, but not served here."""
    assert convert(pub.deepseek_target_with_mtp(tmp_path / "src"), tmp_path / "native") == 0
    with pytest.raises(DraftsmithError, match="MTP layers of a 'deepseek_v3' model cannot be served by draftsmith.*"
                                              "convert --to vllm"):
        load_head(tmp_path / "native")


# -- MTP --------------------------------------------------------------------------------------------------------

def test_deepseek_mtp_reads_only_its_shard(tmp_path):
    src = pub.deepseek_target_with_mtp(tmp_path / "src", layers=2, mtp_layers=1)
    original = load_file(str(src / "model-00002-of-00003.safetensors"))
    # Garble the shards holding the main model: only the MTP shard may be opened.
    for shard in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        (src / shard).write_bytes(b"not a safetensors file")
    assert convert(src, tmp_path / "native") == 0
    config, tensors = native(tmp_path / "native")
    assert len(tensors) == len(original)
    p = "model.layers.2."
    expect = {"layers.0.token_norm.weight": p + "enorm.weight", "layers.0.hidden_norm.weight": p + "hnorm.weight",
              "layers.0.input_proj.weight": p + "eh_proj.weight", "layers.0.final_norm.weight": p + "shared_head.norm.weight",
              "layers.0.lm_head.weight": p + "shared_head.head.weight", "layers.0.embed_tokens.weight": p + "embed_tokens.weight",
              "layers.0.block.mlp.gate.weight": p + "mlp.gate.weight",
              "layers.0.block.mlp.experts.0.gate_proj.weight_scale_inv": p + "mlp.experts.0.gate_proj.weight_scale_inv"}
    for native_name, source_name in expect.items():
        assert torch.equal(tensors[native_name], original[source_name]), native_name
    fp8 = tensors["layers.0.block.mlp.experts.0.gate_proj.weight"]
    assert fp8.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8.view(torch.uint8), original[p + "mlp.experts.0.gate_proj.weight"].view(torch.uint8))
    assert (config["layout"], config["num_layers"], config["target_num_layers"]) == ("deepseek", 1, 2)
    assert config["concat_order"] == "embedding_first" and config["source_config"]["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("to", ["vllm", "sglang"])
def test_deepseek_mtp_round_trips(to, tmp_path):
    src = pub.deepseek_target_with_mtp(tmp_path / "src", layers=2, mtp_layers=2)
    assert convert(src, tmp_path / "native") == 0
    assert_round_trip(tmp_path, to)
    exported = load_file(str(tmp_path / to / "model.safetensors"))
    assert "model.layers.3.eh_proj.weight" in exported and "model.layers.0.input_layernorm.weight" not in exported
    architectures = json.loads((tmp_path / to / "config.json").read_text())["architectures"]
    assert architectures == (["DeepseekV3ForCausalLMNextN"] if to == "sglang" else ["DeepseekV3ForCausalLM"])


def test_qwen3_next_mtp(tmp_path, capsys):
    src = pub.qwen3_next_target_with_mtp(tmp_path / "src")
    original = source_tensors(src)
    assert convert(src, tmp_path / "native") == 0
    config, tensors = native(tmp_path / "native")
    assert config["shared_input_proj"] is True and config["layout"] == "qwen3_next"
    assert torch.equal(tensors["layers.0.input_proj.weight"], original["mtp.fc.weight"])
    assert torch.equal(tensors["layers.0.token_norm.weight"], original["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(tensors["layers.0.block.self_attn.q_proj.weight"], original["mtp.layers.0.self_attn.q_proj.weight"])
    assert not any("embed_tokens" in k or k == "lm_head.weight" for k in tensors)  # shared with the main model
    assert_round_trip(tmp_path, "vllm")
    assert convert(tmp_path / "native", tmp_path / "sg", "--to", "sglang") == 2
    assert "DeepSeek-style MTP, not qwen3_next" in capsys.readouterr().err


def test_mimo_mtp_concatenates_hidden_first(tmp_path):
    src = pub.mimo_target_with_mtp(tmp_path / "src")
    original = source_tensors(src)
    assert convert(src, tmp_path / "native") == 0
    config, tensors = native(tmp_path / "native")
    assert config["concat_order"] == "hidden_first"
    assert torch.equal(tensors["layers.0.hidden_norm.weight"], original["model.mtp_layers.0.hidden_layernorm.weight"])
    assert torch.equal(tensors["layers.0.final_norm.weight"], original["model.mtp_layers.0.final_layernorm.weight"])
    assert len(tensors) == sum(k.startswith("model.mtp_layers.") for k in original)
    assert_round_trip(tmp_path, "vllm")


def test_missing_mtp_parts_are_named(tmp_path, capsys):
    src = pub.mimo_target_with_mtp(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.mtp_layers.0.input_proj.weight"]
    from safetensors.torch import save_file
    save_file(tensors, str(src / "model.safetensors"))
    assert convert(src, tmp_path / "out") == 2
    assert "MTP layer 0 lacks input_proj.weight" in capsys.readouterr().err
