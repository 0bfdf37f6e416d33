"""Every shipped recipe loads through the real schema; names follow one pattern; overrides work."""

import json
import re

import pytest
import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.train.recipe import load_recipe
from helpers import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
LAUNCH_CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    assert re.fullmatch(r"(eagle|eagle3|medusa|mlp|mtp|dflash|dspark|pard)-[a-z0-9.]+(-[a-z0-9.]+)*\.yaml", path.name)
    recipe = load_recipe(path)
    assert recipe.model.head_type == {"mlp": "mlp_speculator", "pard": "draft_model"}.get(*[path.name.split("-")[0]] * 2)


def test_expected_launch_configs_exist_and_parse():
    names = {p.name for p in LAUNCH_CONFIGS}
    assert names == {"cpu.yaml", "single_gpu.yaml", "ddp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml",
                     "fsdp.yaml"}
    for path in LAUNCH_CONFIGS:
        config = yaml.safe_load(path.read_text())
        assert config["distributed_type"] in {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"}
        ds_file = config.get("deepspeed_config", {}).get("deepspeed_config_file")
        if ds_file:
            assert json.loads((REPO / ds_file).read_text())["zero_optimization"]["stage"] in (2, 3)


def test_overrides_and_errors(tmp_path):
    recipe = load_recipe(RECIPES[0], ["training.learning_rate=3e-4", "data.max_length=128"])
    assert recipe.training.learning_rate == 3e-4 and recipe.data.max_length == 128
    with pytest.raises(DraftsmithError, match="training.learnin_rate: Extra inputs are not permitted"):
        load_recipe(RECIPES[0], ["training.learnin_rate=1"])
    with pytest.raises(DraftsmithError, match="batch_size"):
        load_recipe(RECIPES[0], ["training.batch_size=0"])
    with pytest.raises(DraftsmithError, match="must look like"):
        load_recipe(RECIPES[0], ["training.batch_size"])
    with pytest.raises(DraftsmithError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_method_keys_are_valid_only_for_their_method():
    """EAGLE-3's unroll depth and vocab size, EAGLE's feature noise: each method's own sections hold them."""
    eagle3 = REPO / "recipes" / "eagle3-demo.yaml"
    eagle = REPO / "recipes" / "eagle-house.yaml"
    assert load_recipe(eagle3, ["training.ttt_length=3"]).training.ttt_length == 3
    assert load_recipe(eagle, ["training.noise_std=0.1"]).training.noise_std == 0.1
    with pytest.raises(DraftsmithError, match="training.ttt_length: Extra inputs are not permitted"):
        load_recipe(eagle, ["training.ttt_length=3"])
    with pytest.raises(DraftsmithError, match="training.noise_std: Extra inputs are not permitted"):
        load_recipe(eagle3, ["training.noise_std=0.1"])
    with pytest.raises(DraftsmithError, match="model.draft_vocab_size: Extra inputs are not permitted"):
        load_recipe(eagle, ["model.draft_vocab_size=512"])
    with pytest.raises(DraftsmithError, match="'ngram' trains no head; trainable: dflash, draft_model, dspark, eagle, eagle3, "
                                              "medusa, mlp_speculator, mtp$"):
        load_recipe(eagle, ["model.head_type=ngram"])
    with pytest.raises(DraftsmithError, match="'suffix' trains no head; trainable: dflash, draft_model, dspark, eagle, eagle3, "
                                              "medusa, mlp_speculator, mtp$"):
        load_recipe(eagle, ["model.head_type=suffix"])
    with pytest.raises(DraftsmithError, match="an MTP layer is shaped like a layer of the target"):
        load_recipe(eagle, ["model.head_type=mtp", "model.intermediate_size=64"])
    with pytest.raises(DraftsmithError, match="these heads have no decoder layer to size; drop intermediate_size"):
        load_recipe(eagle, ["model.head_type=medusa", "model.intermediate_size=64"])
    variants = load_recipe(eagle3, ["model.norm_before_fc=true", "model.sliding_window=512"]).model
    assert variants.norm_before_fc and variants.sliding_window == 512 and not variants.fc_norm
    with pytest.raises(DraftsmithError, match="norm_before_fc and fc_norm exclude each other"):
        load_recipe(eagle3, ["model.norm_before_fc=true", "model.fc_norm=true"])
    with pytest.raises(DraftsmithError, match="model.norm_output: Extra inputs are not permitted"):
        load_recipe(eagle, ["model.norm_output=true"])


def test_repeated_fused_layers_are_refused_and_the_default_never_repeats():
    """The EAGLE-3 reference formula gives [2, 3, 3] on a 6-layer target (speculators refuses it, and the head
    would read layer 3 twice): named as an error in a recipe, and draftsmith's own default spreads distinct
    layers there, keeping the reference choice wherever that is distinct."""
    from draftsmith.methods.eagle3 import Eagle3Method

    eagle3 = REPO / "recipes" / "eagle3-demo.yaml"
    with pytest.raises(DraftsmithError, match=r"model.aux_layer_ids: .*\[2, 3, 3\] repeats layer 3: each fused"):
        load_recipe(eagle3, ["model.aux_layer_ids=[2,3,3]"])
    assert load_recipe(eagle3, ["model.aux_layer_ids=[1,3,5]"]).model.aux_layer_ids == [1, 3, 5]
    assert Eagle3Method.reference_feature_layers(6) == (2, 3, 3) and Eagle3Method.default_feature_layers(6) == (1, 3, 5)
    for layers in range(2, 81):
        ids = Eagle3Method.default_feature_layers(layers)
        assert len(ids) == 3 and ids[0] < ids[1] < ids[2] and 0 <= ids[0] and ids[2] <= layers, (layers, ids)
        if layers >= 7:
            assert ids == Eagle3Method.reference_feature_layers(layers)
