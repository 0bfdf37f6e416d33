"""`draftsmith convert` for EAGLE-family checkpoints: detection, exact tensor mapping, written configs, round
trips, validation errors, safety, and greedy decoding of converted heads against the demo model."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import public_checkpoints as pub
from draftsmith.cli import build_parser
from draftsmith.methods.formats.checkpoint import SourceCheckpoint
from draftsmith.methods.formats.registry import detect_source, load_formats
from draftsmith.serve import LLM, SamplingParams
from helpers import CODE_PROMPTS, DEMO_MODEL, spec_config

convert, native, source_tensors = pub.convert, pub.read_native, pub.source_tensors


def test_cli_lists_every_registered_source():
    convert_help = build_parser()._subparsers._group_actions[0].choices["convert"].format_help()
    for name in load_formats():
        assert name in convert_help


@pytest.mark.parametrize("build, expected", [
    (pub.yuhuili_eagle, "eagle"), (pub.yuhuili_eagle3, "eagle3"), (pub.specforge_eagle3, "eagle3"),
    (pub.speculators_eagle3, "speculators"), (pub.speculators_legacy_eagle, "speculators"),
])
def test_detection(build, expected, tmp_path):
    assert detect_source(SourceCheckpoint(build(tmp_path / "src"))).name == expected


@pytest.mark.parametrize("fc_bias, embed, qwen2, weights", [
    (True, True, False, "pytorch_model.bin"),  # Vicuna / LLaMA2-chat
    (False, True, False, "pytorch_model.bin"),  # LLaMA3: no fc.bias
    (True, False, False, "model.safetensors"),
    (True, True, True, "pytorch_model.bin"),  # Qwen2: q/k/v biases
])
def test_yuhuili_eagle_maps_every_tensor(fc_bias, embed, qwen2, weights, tmp_path, capsys):
    src = pub.yuhuili_eagle(tmp_path / "src", fc_bias=fc_bias, embed=embed, qwen2=qwen2, weights=weights)
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "out")
    original = source_tensors(src)
    original.pop("embed_tokens.weight", None)  # the frozen copy of the target's embedding is not kept
    assert tensors.keys() == original.keys() and all(torch.equal(tensors[k], original[k]) for k in original)
    assert config["draftsmith_head_type"] == "eagle" and config["fc_bias"] is fc_bias
    assert config["attention_bias"] is qwen2 and config["aux_layer_ids"] == [6] and config["target_num_layers"] == 6
    assert config["vocab_size"] == 8192 and config["target_model"] == str(DEMO_MODEL)
    if embed:
        assert "dropped embed_tokens.weight" in capsys.readouterr().out


def test_yuhuili_eagle3_defaults_to_the_reference_layers(tmp_path, capsys):
    src = pub.yuhuili_eagle3(tmp_path / "src")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 0
    # what the reference code trained on, repeats and all, and said so
    assert "repeats a layer (draftsmith trains [1, 3, 5] there" in capsys.readouterr().out
    config, tensors = native(tmp_path / "out")
    original = source_tensors(src)
    assert tensors.keys() == original.keys() and all(torch.equal(tensors[k], original[k]) for k in original)
    assert tensors["lm_head.weight"].dtype == torch.float16  # dtype kept unless --dtype
    assert config["aux_layer_ids"] == [2, 3, 3]  # hs[2], hs[L//2], hs[L-3] for L = 6
    assert (config["draft_vocab_size"], config["vocab_size"], config["fc_bias"]) == (2048, 8192, False)


def test_specforge_ids_are_output_of_layer(tmp_path):
    src = pub.specforge_eagle3(tmp_path / "src", layer_ids=(0, 2, 4))
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 0
    assert native(tmp_path / "out")[0]["aux_layer_ids"] == [1, 3, 5]


def test_speculators_eagle3_renames_layers_and_drops_the_embedding(tmp_path):
    src = pub.speculators_eagle3(tmp_path / "src", layer_ids=(1, 3, 5))
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "out")
    original = source_tensors(src)
    assert torch.equal(tensors["midlayer.self_attn.q_proj.weight"], original["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], original["layers.0.hidden_norm.weight"])
    assert "embed_tokens.weight" not in tensors and len(tensors) == len(original) - 1
    assert config["aux_layer_ids"] == [1, 3, 5]


def test_speculators_legacy_eagle(tmp_path):
    src = pub.speculators_legacy_eagle(tmp_path / "src")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "out")
    original = source_tensors(src)
    assert torch.equal(tensors["fc.bias"], original["fusion_fc.bias"])
    assert torch.equal(tensors["layers.0.mlp.down_proj.weight"], original["transformer.mlp.down_proj.weight"])
    assert config["fc_bias"] is True and config["target_model"] == str(DEMO_MODEL)


@pytest.mark.parametrize("build", [pub.yuhuili_eagle, pub.specforge_eagle3, pub.yuhuili_eagle3_narrow])
@pytest.mark.parametrize("to", ["vllm", "sglang", "speculators"])
def test_native_round_trips_are_lossless(build, to, tmp_path):
    assert convert(build(tmp_path / "src"), tmp_path / "native", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "native")
    if to == "speculators" and config["own_embedding"]:
        assert convert(tmp_path / "native", tmp_path / "x", "--to", to) == 2  # that layout has no draft embedding
        return
    assert convert(tmp_path / "native", tmp_path / "x", "--to", to) == 0
    assert convert(tmp_path / "x", tmp_path / "back") == 0  # no --target: the export records what it needs
    config_back, tensors_back = native(tmp_path / "back")
    assert config_back == config
    assert tensors_back.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors_back[k]) and tensors[k].dtype == tensors_back[k].dtype for k in tensors)


@pytest.mark.parametrize("qwen2", [False, True])
def test_a_vllm_eagle_export_builds_no_bias_its_file_lacks(qwen2, tmp_path):
    """vLLM's Llama layer takes attention biases from `attention_bias or bias` (q/k/v's alone from `qkv_bias`):
    yuhuili's `bias` (the fc's) there left vLLM an unfilled q/k/v/o bias and the demo EAGLE-1 head accepting
    nothing (1.00 against 1.41)."""
    src = pub.yuhuili_eagle(tmp_path / "src", fc_bias=True, qwen2=qwen2, weights="model.safetensors")
    assert convert(src, tmp_path / "n", "--target", DEMO_MODEL) == 0
    assert convert(tmp_path / "n", tmp_path / "vllm", "--to", "vllm") == 0
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert (config["bias"], config["attention_bias"], config["qkv_bias"]) == (False, False, qwen2)
    assert ("layers.0.self_attn.q_proj.bias" in source_tensors(tmp_path / "vllm")) is qwen2
    assert "layers.0.self_attn.o_proj.bias" not in source_tensors(tmp_path / "vllm")


def test_a_windowed_eagle_head_keeps_its_window_in_vllms_keys(tmp_path, capsys):
    """vLLM's EAGLE-1 numbers its draft layer after the target's (`layers.6` on the demo model) and reads
    `layer_types` at that number less `target_layer_count`, which only its EAGLE-3 sets: the export sets it
    (transformers wants one entry per layer); the export reads back as the same head. SGLang's
    EAGLE-1 and the legacy speculators layout attend over the whole context: a windowed head is refused there."""
    src = pub.yuhuili_eagle(tmp_path / "src", weights="model.safetensors")
    source_config = json.loads((src / "config.json").read_text())
    source_config.update(layer_types=["sliding_attention"], sliding_window=64)
    (src / "config.json").write_text(json.dumps(source_config))
    assert convert(src, tmp_path / "n", "--target", DEMO_MODEL) == 0
    config = native(tmp_path / "n")[0]
    assert config["sliding_window"] == 64
    assert convert(tmp_path / "n", tmp_path / "vllm", "--to", "vllm") == 0
    assert "sliding window 64: needs vLLM 0.32 or later" in capsys.readouterr().out
    exported = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert exported["layer_types"] == ["sliding_attention"] and exported["sliding_window"] == 64
    assert exported["target_layer_count"] == 6
    assert convert(tmp_path / "vllm", tmp_path / "back") == 0
    assert native(tmp_path / "back")[0] == config
    for to in ("sglang", "speculators"):
        assert convert(tmp_path / "n", tmp_path / to, "--to", to) == 2
        assert "has no attention window" in capsys.readouterr().err
        assert not (tmp_path / to).exists()


def test_exported_configs_follow_each_loader(tmp_path):
    assert convert(pub.specforge_eagle3(tmp_path / "src"), tmp_path / "n", "--target", DEMO_MODEL) == 0
    for to in ("vllm", "sglang", "speculators"):
        assert convert(tmp_path / "n", tmp_path / to, "--to", to) == 0
    vllm = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert vllm["architectures"] == ["LlamaForCausalLMEagle3"] and vllm["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert vllm["norm_before_residual"] is False and vllm["draft_vocab_size"] == 2048
    assert "midlayer.fc" not in load_file(str(tmp_path / "vllm" / "model.safetensors"))
    sglang = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sglang["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 4], "use_aux_hidden_state": True}
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["transformer_layer_config"]["vocab_size"] == 8192
    assert spec["speculators_config"]["verifier"]["name_or_path"] == str(DEMO_MODEL)
    assert spec["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    keys = load_file(str(tmp_path / "speculators" / "model.safetensors")).keys()
    assert "layers.0.hidden_norm.weight" in keys and not any(k.startswith("midlayer.") for k in keys)


def test_exports_name_the_target_by_a_path_that_works_anywhere(tmp_path, monkeypatch, capsys):
    """The shipped head records its target as `assets/demo-code-7m`: copied as it is, the speculators export
    would load only from the repository root (vLLM would go to the hub from anywhere else)."""
    shipped = DEMO_MODEL.parent / "demo-code-7m-eagle3"
    assert json.loads((shipped / "config.json").read_text())["target_model"] == "assets/demo-code-7m"

    def verifier(out):
        return json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]

    monkeypatch.chdir(DEMO_MODEL.parents[1])  # where the recorded path resolves: made absolute
    assert convert(shipped, tmp_path / "a", "--to", "speculators") == 0
    assert verifier(tmp_path / "a") == str(DEMO_MODEL)
    monkeypatch.chdir(tmp_path)  # where it does not: kept, with a warning naming the fix
    capsys.readouterr()
    assert convert(shipped, tmp_path / "b", "--to", "speculators") == 0
    assert verifier(tmp_path / "b") == "assets/demo-code-7m"
    warning = capsys.readouterr().out
    assert "'assets/demo-code-7m' is not a directory here" in warning and "pass --target TARGET_DIR" in warning
    copy = shutil.copytree(DEMO_MODEL, tmp_path / "my-target")  # --target names it, wherever the head says
    assert convert(shipped, tmp_path / "c", "--to", "speculators", "--target", "my-target") == 0
    assert verifier(tmp_path / "c") == str(copy.resolve())


def test_speculators_heads_import_without_target_when_their_verifier_is_here(tmp_path, capsys):
    local = pub.speculators_eagle3(tmp_path / "local", verifier=str(DEMO_MODEL))
    assert convert(local, tmp_path / "a") == 0  # the verifier's config gives the layer count
    config = native(tmp_path / "a")[0]
    assert (config["target_model"], config["target_num_layers"], config["aux_layer_ids"]) == (str(DEMO_MODEL), 6, [1, 3, 5])
    hub = pub.speculators_eagle3(tmp_path / "hub", verifier="org/demo-code-7m")  # never downloaded
    assert convert(hub, tmp_path / "b") == 2
    assert "pass --target TARGET_DIR" in capsys.readouterr().err
    assert convert(hub, tmp_path / "b", "--target", DEMO_MODEL) == 0


def test_a_trained_embedding_is_kept_a_copied_one_dropped(tmp_path, capsys):
    """speculators' `embed_requires_grad: true` heads carry their own trained embedding: dropped as a copy of the
    target's, the imported head drafted differently from the original. Sources without the flag are checked
    against the target's embedding when --target is given."""
    src = pub.speculators_eagle3(tmp_path / "trained", embed_requires_grad=True)
    assert convert(src, tmp_path / "n", "--target", DEMO_MODEL) == 0
    config, tensors = native(tmp_path / "n")
    assert config["own_embedding"] is True
    assert torch.equal(tensors["embed_tokens.weight"], source_tensors(src)["embed_tokens.weight"])
    assert "kept the head's own trained embed_tokens (embed_requires_grad: true)" in capsys.readouterr().out
    assert convert(tmp_path / "n", tmp_path / "s", "--to", "speculators") == 0  # and exports as speculators has it
    assert json.loads((tmp_path / "s" / "config.json").read_text())["embed_requires_grad"] is True
    assert convert(tmp_path / "s", tmp_path / "back") == 0
    assert native(tmp_path / "back")[1]["embed_tokens.weight"].equal(tensors["embed_tokens.weight"])
    # a yuhuili-layout head with an embedding: the target's copy is dropped, anything else kept
    target_embedding = load_file(str(DEMO_MODEL / "model.safetensors"))["model.embed_tokens.weight"]
    for embedding, kept in ((target_embedding, False), (target_embedding + 0.01, True)):
        head = pub.yuhuili_eagle3(tmp_path / f"y{kept}")
        weights = torch.load(head / "pytorch_model.bin", weights_only=True)
        torch.save({**weights, "embed_tokens.weight": embedding.half()}, head / "pytorch_model.bin")
        assert convert(head, tmp_path / f"yn{kept}", "--target", DEMO_MODEL) == 0
        assert native(tmp_path / f"yn{kept}")[0]["own_embedding"] is kept


def test_a_head_fusing_a_layer_twice_does_not_export_to_speculators(tmp_path, capsys):
    # yuhuili's reference default on a 6-layer target: [2, 3, 3], which speculators refuses
    assert convert(pub.yuhuili_eagle3(tmp_path / "src"), tmp_path / "n", "--target", DEMO_MODEL) == 0
    assert convert(tmp_path / "n", tmp_path / "s", "--to", "speculators") == 2
    assert "fuses target layers [2, 3, 3], repeating one, which speculators refuses" in capsys.readouterr().err
    assert convert(tmp_path / "n", tmp_path / "v", "--to", "vllm") == 0  # vLLM's loader takes them


# -- validation -------------------------------------------------------------------------------------------------

def _target_variant(tmp_path, **changes):
    target = tmp_path / "target"
    shutil.copytree(DEMO_MODEL, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": 512}, "hidden size 256, but the target has 512"),
    ({"vocab_size": 9000}, "vocab size 8192, but the target has 9000"),
])
def test_target_mismatch_names_both_values(changes, message, tmp_path, capsys):
    src = pub.specforge_eagle3(tmp_path / "src")
    assert convert(src, tmp_path / "out", "--target", _target_variant(tmp_path, **changes)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fused_layers_beyond_the_target_are_rejected(tmp_path, capsys):
    src = pub.specforge_eagle3(tmp_path / "src", layer_ids=(1, 10, 20))
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "aux_layer_ids [11, 21] out of range for a 6-layer target" in capsys.readouterr().err


def test_d2t_outside_the_vocab_is_rejected(tmp_path, capsys):
    src = pub.specforge_eagle3(tmp_path / "src")
    tensors = load_file(str(src / "model.safetensors"))
    tensors["d2t"][-1] = 9000
    from safetensors.torch import save_file
    save_file(tensors, str(src / "model.safetensors"))
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "outside the target vocab 0..8191" in capsys.readouterr().err


def test_a_different_tokenizer_is_rejected(tmp_path, capsys):
    src = pub.yuhuili_eagle(tmp_path / "src")
    tokenizer = json.loads((DEMO_MODEL / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz_" + first] = vocab.pop(first)
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(DEMO_MODEL / "tokenizer_config.json", src / "tokenizer_config.json")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "differs from the target's" in capsys.readouterr().err


def test_yuhuili_heads_need_the_target(tmp_path, capsys):
    assert convert(pub.yuhuili_eagle3(tmp_path / "src"), tmp_path / "out") == 2
    assert "pass --target" in capsys.readouterr().err


def test_unsupported_variants_are_named(tmp_path, capsys):
    src = pub.specforge_eagle3(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    for changes, message in [({"fc_norm": True}, "fc_norm expects fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight"),
                             ({"norm_output": False}, "norm_output=false (SpecForge: no final norm before the LM head)"),
                             ({"num_hidden_layers": 2}, "lacks tensor(s) layers.1.self_attn.q_proj.weight"),
                             ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, not 0"),
                             ({"reuse_target_lm_head": True}, "reuse_target_lm_head=true (the target's LM head")]:
        (src / "config.json").write_text(json.dumps({**config, **changes}))
        assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
        assert message in capsys.readouterr().err
    src = pub.yuhuili_eagle(tmp_path / "src2")
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    state["layers.0.input_layernorm.weight"] = torch.ones(256)
    torch.save(state, src / "pytorch_model.bin")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "layers.0.input_layernorm.weight are not part of the EAGLE-1 layout" in capsys.readouterr().err


# -- safety -----------------------------------------------------------------------------------------------------

class NotATensor:
    pass


def test_pickled_objects_are_refused(tmp_path, capsys):
    src = pub.yuhuili_eagle(tmp_path / "src")
    torch.save({"fc.weight": NotATensor()}, src / "pytorch_model.bin")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "only plain tensor state dicts are loaded" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_truncated_weights_give_a_clear_error_and_no_output(weights, tmp_path, capsys):
    src = pub.yuhuili_eagle(tmp_path / "src", weights=weights)
    data = (src / weights).read_bytes()
    (src / weights).write_bytes(data[: len(data) // 2])
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    err = capsys.readouterr().err
    assert "truncated or corrupted" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out*")) == []


def test_existing_output_needs_force(tmp_path, capsys):
    src = pub.yuhuili_eagle(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL) == 2
    assert "--force" in capsys.readouterr().err and (tmp_path / "out" / "keep.txt").exists()
    assert convert(src, tmp_path / "out", "--target", DEMO_MODEL, "--force") == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").is_file()


def test_inspect_prints_and_writes_nothing(tmp_path, capsys):
    src = pub.yuhuili_eagle3(tmp_path / "src")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert convert("--inspect", src, "--target", DEMO_MODEL, "--to", "vllm") == 0
    out = capsys.readouterr().out
    assert "format:     eagle3" in out and "method:     eagle3" in out and "tensors:    15" in out
    assert "dtype:      float16" in out and '"LlamaForCausalLMEagle3"' in out
    params = sum(v.numel() for v in source_tensors(src).values() if v.is_floating_point())
    assert f"parameters: {params:,}" in out
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_unknown_layouts_ask_for_from(tmp_path, capsys):
    pub._write(tmp_path / "src", {}, {"foo.weight": torch.zeros(2)}, "model.safetensors")
    assert convert(tmp_path / "src", tmp_path / "out") == 2
    assert "cannot tell the format" in capsys.readouterr().err


# -- converted heads decode losslessly --------------------------------------------------------------------------

@pytest.mark.parametrize("build, method", [
    (lambda d: pub.yuhuili_eagle(d, qwen2=True), "eagle"), (pub.speculators_legacy_eagle, "eagle"),
    (pub.yuhuili_eagle3, "eagle3"), (pub.specforge_eagle3, "eagle3"), (pub.yuhuili_eagle3_narrow, "eagle3"),
])
@pytest.mark.slow
def test_converted_heads_keep_greedy_outputs(build, method, tmp_path, greedy_reference):
    assert convert(build(tmp_path / "src"), tmp_path / "head", "--target", DEMO_MODEL) == 0
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              # fixed k: these heads are random, so the adaptive policy may rightly stop drafting with them
              speculative_config=spec_config(method, tmp_path / "head", 3))
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0


@pytest.mark.parametrize("to", ["vllm", "speculators"])
def test_a_dflash_head_on_the_last_layer_says_vllm_reads_it_before_the_norm(to, tmp_path, capsys):
    """The shipped DFlash head fuses layers 1-6 of a 6-layer target: its layer 6 is the final-normed state here,
    the pre-norm one in vLLM and SGLang, which no key of their layouts can say."""
    assert pub.convert(DEMO_MODEL.with_name("demo-code-7m-dflash"), tmp_path / to, "--to", to,
                       "--target", DEMO_MODEL) == 0
    assert "note: the head reads the target's last layer (6), which draftsmith trains on after the final norm" \
        in capsys.readouterr().out
