"""A method has one home: a toy method defined only in this file (its config section, recipe section, head
type and proposer) runs through `LLM(..., speculative_config=...)`, `draftsmith generate` and the recipe
validator, and disappears from all of them when unregistered. Nothing outside this file knows it.

The toy drafts from a bigram table: row t holds the target's next-token logits after the single token t.
It can sample its drafts, so it also declares draft probabilities.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
import torch
from pydantic import Field
from safetensors.torch import save_file
from torch import nn

from draftsmith.cli import build_parser, main
from draftsmith.errors import DraftsmithError
from draftsmith.methods import (
    DraftBatch,
    MethodNeeds,
    Proposer,
    RecipeModelSection,
    RecipeTrainingSection,
    SpecMethod,
    SpeculativeConfig,
    load_head,
    register_method,
    unregister_method,
)
from draftsmith.models import load_target
from draftsmith.models.head_configs import HeadConfig, check_sizes
from draftsmith.serve import LLM, SamplingParams
from draftsmith.train.recipe import validate_recipe
from helpers import DEMO_MODEL, spec_config

PROMPTS = ["def add(a, b):\n    return a", "for i in range(10):\n    print(", "class Node:\n    def __init__(self"]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@dataclass
class BigramHeadConfig(HeadConfig):
    head_type: ClassVar[str] = "toy_bigram"
    vocab_size: int
    hidden_size: int

    def check_target(self, target):
        check_sizes("bigram", self.hidden_size, self.vocab_size, target)


class BigramHead(nn.Module):
    head_type = "toy_bigram"

    def __init__(self, config: BigramHeadConfig):
        super().__init__()
        self.config = config
        self.table = nn.Parameter(torch.zeros(config.vocab_size, config.vocab_size))


class ToyConfig(SpeculativeConfig):
    method: Literal["toy_bigram"]
    chain_temperature: float = Field(default=1.0, gt=0)  # the toy's own key: scales its sampled drafts


class ToyRecipe(RecipeModelSection):
    head_type: Literal["toy_bigram"]
    smoothing: float = Field(default=0.0, ge=0)


class ToyTraining(RecipeTrainingSection):
    table_weight_decay: float = Field(default=0.0, ge=0)


class ToyProposer(Proposer):
    def __init__(self, config, target, max_num_seqs, max_model_len):
        super().__init__(config, target, max_num_seqs, max_model_len)
        self.head = load_head(config.model)  # through the registry, by the head type in its config.json
        self.temperature = config.chain_temperature
        self.tokens = torch.full((max_num_seqs, config.num_speculative_tokens), -1, dtype=torch.long)
        self.counts = torch.zeros(max_num_seqs, dtype=torch.long)
        self.probs = torch.zeros(max_num_seqs, config.num_speculative_tokens, config_vocab(self.head))

    def propose(self, rows, max_drafts, sampling=None, stop_below=0.0):
        n = len(rows)
        tokens, counts, probs = self.tokens[:n], self.counts[:n], self.probs[:n]
        tokens.fill_(-1)
        counts.copy_(torch.tensor(max_drafts))
        current = torch.tensor([r.all_token_ids()[-1] for r in rows])
        for step in range(max(max_drafts, default=0)):
            logits = self.head.table[current].detach()
            q = torch.softmax(logits / self.temperature, dim=-1)
            chosen = logits.argmax(-1)
            live = step < counts
            if sampling is not None:
                # a drafting row with temperature > 0 draws from q with its own generator, and only while it
                # drafts: what it draws must not depend on the other rows in the batch
                for b in range(n):
                    if live[b] and sampling.temperature[b] > 0:
                        chosen[b] = torch.multinomial(q[b], 1, generator=sampling.generators[b])[0]
            tokens[:, step] = torch.where(live, chosen, -1)
            probs[:, step] = q
            current = chosen
        return DraftBatch(tokens, counts, probs if sampling is not None else None)


def config_vocab(head) -> int:
    return head.config.vocab_size


class ToyMethod(SpecMethod):
    name = "toy_bigram"
    section = ToyConfig
    recipe_section = ToyRecipe
    training_section = ToyTraining
    needs = MethodNeeds(head=True, draft_probs=True)
    head_type = "toy_bigram"
    head_config = BigramHeadConfig
    head_module = BigramHead

    @classmethod
    def proposer_class(cls):
        return ToyProposer

    @classmethod
    def objective(cls):
        return lambda head, target, batch, feats, cfg: (head.table.sum() * 0, {})


@pytest.fixture(scope="module")
def toy_head(tmp_path_factory):
    """Registers the toy for this module and writes its head: the demo model's own bigram predictions."""
    register_method(ToyMethod)
    target = load_target(DEMO_MODEL, dtype="float32")
    vocab = target.config.vocab_size
    with torch.inference_mode():
        table = torch.cat([target(torch.arange(s, min(s + 1024, vocab))[:, None]).logits[:, 0]
                           for s in range(0, vocab, 1024)])
    directory = tmp_path_factory.mktemp("toy_head")
    (directory / "config.json").write_text(json.dumps(BigramHeadConfig(vocab, target.config.hidden_size).to_json()))
    save_file({"table": table.contiguous()}, str(directory / "model.safetensors"))
    yield directory
    unregister_method("toy_bigram")


@pytest.fixture(scope="module")
def reference_ids():
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_toy_method_serves_through_llm_losslessly(toy_head, reference_ids):
    # fixed k: the adaptive policy would soon stop drafting with a head this weak (few drafts are accepted)
    spec = spec_config("toy_bigram", toy_head, 3)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256, speculative_config=spec)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # 3 prompts on 2 slots: mixed batches
    assert [o.outputs[0].token_ids for o in outputs] == reference_ids
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_toy_method_samples_its_drafts_reproducibly(toy_head):
    # sampled drafts repeat for a fixed k; adaptive k changes which draws happen
    spec = spec_config("toy_bigram", toy_head, 3, draft_sample_method="probabilistic", chain_temperature=0.7)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, speculative_config=spec)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24) for i in range(len(PROMPTS))]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    alone = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert batched == alone
    assert llm.get_metrics()["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_toy_method_through_generate_cli(toy_head, reference_ids, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    spec = json.dumps(spec_config("toy_bigram", toy_head, 2))  # fixed k: the policy may not draft with a head this weak
    argv = ["generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"),
            "--max-tokens", "32", "--temperature", "0", "--device", "cpu", "--max-model-len", "256",
            "--metrics-json", str(tmp_path / "m.json"), "--speculative-config", spec]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == reference_ids
    assert json.loads((tmp_path / "m.json").read_text())["num_drafts"] > 0
    generate_help = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "toy_bigram" in generate_help  # the CLI lists methods from the registry


def test_toy_config_keys_are_its_own(toy_head):
    from draftsmith.serve.speculation.config import parse_speculative_config

    with pytest.raises(DraftsmithError, match="chain_temp.*valid keys: .*chain_temperature"):
        parse_speculative_config({"method": "toy_bigram", "model": "x", "num_speculative_tokens": 2, "chain_temp": 1})
    with pytest.raises(DraftsmithError, match="prompt_lookup_max"):  # n-gram's key is not the toy's
        parse_speculative_config({"method": "toy_bigram", "model": "x", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": 3})
    with pytest.raises(DraftsmithError, match="needs \"model\""):  # its declared needs are enforced
        parse_speculative_config({"method": "toy_bigram", "num_speculative_tokens": 2})


def _recipe(head_type, training=None, **model):
    return {"model": {"target": str(DEMO_MODEL), "head_type": head_type, **model},
            "data": {"train_files": ["x.jsonl"]}, "training": {"output_dir": "out", **(training or {})}}


def test_recipe_validator_takes_the_toy_section(toy_head):
    recipe = validate_recipe(_recipe("toy_bigram", {"table_weight_decay": 0.5}, smoothing=0.1))
    assert recipe.model.smoothing == 0.1 and recipe.model.head_type == "toy_bigram"
    assert recipe.training.table_weight_decay == 0.5
    with pytest.raises(DraftsmithError, match="training.ttt_length"):  # EAGLE-3's training knob is not the toy's
        validate_recipe(_recipe("toy_bigram", {"ttt_length": 3}))
    with pytest.raises(DraftsmithError, match="draft_vocab_size"):  # EAGLE-3's key is not the toy's
        validate_recipe(_recipe("toy_bigram", draft_vocab_size=512))
    with pytest.raises(DraftsmithError, match="smoothing"):  # and the toy's key is not EAGLE-3's
        validate_recipe(_recipe("eagle3", smoothing=0.1))


def test_unregistered_toy_is_gone_everywhere(toy_head):
    from draftsmith.serve.speculation.config import parse_speculative_config

    unregister_method("toy_bigram")
    try:
        with pytest.raises(DraftsmithError, match="'toy_bigram' is unknown; available: dflash, draft_model, dspark, eagle, eagle3, medusa, mlp_speculator, mtp, ngram, suffix"):
            parse_speculative_config({"method": "toy_bigram", "model": "x", "num_speculative_tokens": 2})
        with pytest.raises(DraftsmithError,
                           match="'toy_bigram' is unknown; available: dflash, draft_model, dspark, eagle, eagle3, medusa, mlp_speculator, mtp$"):
            validate_recipe(_recipe("toy_bigram"))
        with pytest.raises(DraftsmithError, match="draftsmith_head_type 'toy_bigram' is not one of"):
            load_head(toy_head)
    finally:
        register_method(ToyMethod)


def test_registration_refuses_inconsistent_methods(toy_head):  # the toy is registered
    class Misnamed(ToyMethod):
        name = "toy_other"  # its section still says method "toy_bigram"

    with pytest.raises(ValueError, match="Literal\\['toy_other'\\]"):
        register_method(Misnamed)

    class OtherConfig(SpeculativeConfig):
        method: Literal["toy_other"]

    class WrongHead(ToyMethod):
        name = "toy_other"
        section = OtherConfig
        recipe_section = None
        head_type = "toy_bigram"  # a head type names the method that runs it

    with pytest.raises(ValueError, match="head_type must be None or 'toy_other'"):
        register_method(WrongHead)
    with pytest.raises(ValueError, match="already registered"):
        register_method(ToyMethod)
