import json
import warnings

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.serve import LLM
from draftsmith.serve.speculation.config import parse_speculative_config
from helpers import DEMO_MODEL


def test_vllm_prompt_lookup_defaults_and_mirroring():
    both_unset = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (both_unset.prompt_lookup_min, both_unset.prompt_lookup_max) == (5, 5)
    only_max = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("config,message", [
    ({"method": "ngram", "num_speculative_tokens": 3, "bogus": 1}, "bogus.*valid keys: method"),
    ({"method": "dflash", "num_speculative_tokens": 3}, "needs \"model\""),
    ({"method": "lookahead", "num_speculative_tokens": 3},
     "'lookahead' is unknown; available: dflash, draft_model, dspark, eagle, eagle3, medusa, mlp_speculator, mtp, ngram, suffix"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "greater than"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "only 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"}, "synthetic_acceptance_rate"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "fast"}, "rejection_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ("{not json", "not valid JSON"),
])
def test_bad_configs_are_one_clear_error(config, message):
    with pytest.raises(DraftsmithError, match=message):
        parse_speculative_config(config)


def test_legacy_keywords_map_with_deprecation_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1, max_model_len=64,
                  speculative_model="[ngram]", num_speculative_tokens=3, ngram_prompt_lookup_max=4)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    config = llm.engine.spec_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 3, 4, 4)
    with pytest.raises(TypeError, match="speculative_modle"):
        LLM(DEMO_MODEL, speculative_modle="[ngram]")
    assert json.loads(config.model_dump_json())["method"] == "ngram"


def test_config_objects_get_the_same_checks_as_json():
    from draftsmith.methods import SpeculativeConfig
    from draftsmith.methods.eagle import EagleConfig

    ngram = parse_speculative_config(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert (type(ngram).__name__, ngram.prompt_lookup_min, ngram.prompt_lookup_max) == ("NgramConfig", 5, 5)
    with pytest.raises(DraftsmithError, match="needs \"model\""):
        parse_speculative_config(EagleConfig(method="eagle", num_speculative_tokens=3))


def test_bench_keeps_the_users_config_for_a_method_that_also_ships_a_head():
    from draftsmith.serve.bench.matrix import speculation_methods

    mine = {"method": "eagle3", "model": "/my/head", "num_speculative_tokens": 2}
    methods = speculation_methods("demo-code-7m", json.dumps(mine), k=5)
    assert methods["eagle3"] == mine  # not replaced by assets/demo-code-7m-eagle3
    assert speculation_methods("demo-code-7m", "", k=5)["eagle3"]["num_speculative_tokens"] == 5


def test_bench_runs_a_list_of_configs_and_names_parallel_draft_models_pard():
    from draftsmith.serve.bench.matrix import speculation_methods

    draft = {"method": "draft_model", "model": "/draft", "num_speculative_tokens": 4}
    pard = {**draft, "parallel_drafting": True}
    methods = speculation_methods("house-code-28m", json.dumps([draft, pard]), k=5)
    assert methods == {"draft_model": draft, "pard": pard}
    with pytest.raises(DraftsmithError, match="names 'draft_model' twice"):
        speculation_methods("house-code-28m", json.dumps([draft, draft]), k=5)
    # two heads of one method side by side (e.g. one in bf16, one in fp32): the second row is named by its folder
    other = {**draft, "model": "/heads/draft-fp32"}
    assert list(speculation_methods("house-code-28m", json.dumps([draft, other]), k=5)) == [
        "draft_model", "draft_model@draft-fp32"]
    with pytest.raises(DraftsmithError, match="a JSON object, or a list of them"):
        speculation_methods("house-code-28m", "[3]", k=5)


def test_bench_runs_the_planner_and_a_fixed_k_of_one_method_side_by_side():
    from draftsmith.serve.bench.matrix import speculation_methods

    planned = {"method": "ngram", "num_speculative_tokens": 4}
    fixed = {**planned, "adaptive": False}
    parallel = {"method": "eagle3", "model": "/peagle", "num_speculative_tokens": 3, "parallel_drafting": True}
    parallel_fixed = {**parallel, "adaptive": False}
    methods = speculation_methods("demo-code-7m", json.dumps([planned, fixed, parallel_fixed, parallel]), k=5)
    assert methods["ngram"] == planned and methods["ngram-fixed"] == fixed
    assert methods["peagle"] == parallel and methods["peagle-fixed"] == parallel_fixed
    assert list(methods)[:4] == ["ngram", "ngram-fixed", "peagle-fixed", "peagle"]  # as listed
    # alone, a fixed config keeps the method's name (what a comparison with vLLM's fixed k runs)
    assert list(speculation_methods("demo-code-7m", json.dumps([fixed]), k=5))[0] == "ngram"
    # the same drafter at another k: named by it
    narrower = {**fixed, "num_speculative_tokens": 2}
    assert list(speculation_methods("demo-code-7m", json.dumps([planned, fixed, narrower]), k=5))[:3] == [
        "ngram", "ngram-fixed", "ngram-fixed@k2"]


def test_validation_errors_format_in_one_line():
    from pydantic import BaseModel, ConfigDict, ValidationError

    from draftsmith.errors import format_validation_error

    class Body(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: int

    try:
        Body.model_validate([1])
    except ValidationError as exc:
        assert format_validation_error(exc).startswith("config: ")
        assert not format_validation_error(exc, whole="").startswith(":")
    try:
        Body.model_validate({"n": "x", "m": 1})
    except ValidationError as exc:
        assert format_validation_error(exc, ["n"]) == (
            "n: Input should be a valid integer, unable to parse string as an integer; "
            "m: Extra inputs are not permitted (valid keys: n)")
