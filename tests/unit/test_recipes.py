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
    assert re.fullmatch(r"(eagle|eagle3)-[a-z0-9.]+(-[a-z0-9.]+)*\.yaml", path.name)
    recipe = load_recipe(path)
    assert recipe.model.head_type == path.name.split("-")[0]


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
    with pytest.raises(DraftsmithError, match="'medusa' is not available yet; available: eagle, eagle3"):
        load_recipe(eagle, ["model.head_type=medusa"])
