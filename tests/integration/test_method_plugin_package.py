"""A method from another distribution: a toy package written here, with its own head, proposer, objective and
converter, declared by a `draftsmith.methods` entry point, is found, trained one step by a recipe, converted out
and back in, and served with greedy equality, each by a fresh `python -m draftsmith` process. Nothing outside
this file names it.

The toy drafts with a low-rank bigram (the next token from the current one alone): trained on text, then
exported to a "foreign" layout of its own (as `--to vllm`) and read back through its own source format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import CODE_PROMPTS, DEMO_MODEL, spec_config, write_code_corpus

PACKAGE = {
    "toy_plugin/__init__.py": "",
    "toy_plugin/bigram/__init__.py": '''
        """The toy method: registered on import, its parts named by reference."""
        from typing import Literal

        from pydantic import Field

        from draftsmith.methods import (MethodNeeds, RecipeModelSection, SpecMethod, SpeculativeConfig,
                                        register_method)
        from toy_plugin.bigram.head import BigramHead, BigramHeadConfig


        class BigramSpecConfig(SpeculativeConfig):
            method: Literal["toy_bigram"]


        class BigramRecipe(RecipeModelSection):
            head_type: Literal["toy_bigram"]
            rank: int = Field(default=16, gt=0)


        @register_method
        class BigramMethod(SpecMethod):
            name = "toy_bigram"
            section = BigramSpecConfig
            recipe_section = BigramRecipe
            needs = MethodNeeds(head=True)
            head_type = "toy_bigram"
            head_config = BigramHeadConfig
            head_module = BigramHead
            converters = ("toy_plugin.bigram.convert",)
            proposer_ref = ".proposer:BigramProposer"
            objective_ref = ".objective:bigram_objective"

            @classmethod
            def build_head(cls, section, target, aux_layer_ids, token_records):
                config = BigramHeadConfig(vocab_size=target.config.vocab_size, rank=section.rank,
                                          target_model=section.target)
                return BigramHead(config).attach_target(target)

            @classmethod
            def default_feature_layers(cls, num_layers):
                return ()  # reads no target layers: trains on text alone
    ''',
    "toy_plugin/bigram/head.py": '''
        from dataclasses import dataclass
        from typing import ClassVar

        from torch import nn

        from draftsmith.errors import DraftsmithError
        from draftsmith.models.head_configs import HeadConfig
        from draftsmith.models.heads import AttachedHead


        @dataclass
        class BigramHeadConfig(HeadConfig):
            head_type: ClassVar[str] = "toy_bigram"
            vocab_size: int
            rank: int = 16
            target_model: str = ""

            def check_target(self, target):
                if target.vocab_size != self.vocab_size:
                    raise DraftsmithError(f"bigram vocab {self.vocab_size} != target vocab {target.vocab_size}")


        class BigramHead(AttachedHead):
            head_type = "toy_bigram"
            feature_layers = ()

            def __init__(self, config):
                super().__init__(config)
                self.embed = nn.Embedding(config.vocab_size, config.rank)
                self.out = nn.Linear(config.rank, config.vocab_size, bias=False)

            def forward(self, token_ids):
                return self.out(self.embed(token_ids))
    ''',
    "toy_plugin/bigram/objective.py": '''
        import torch.nn.functional as F


        def bigram_objective(head, target, batch, features, cfg):
            ids, mask = batch["input_ids"], batch["loss_mask"][:, 1:].flatten().float()
            logits = head(ids[:, :-1]).flatten(0, 1).float()
            loss = (F.cross_entropy(logits, ids[:, 1:].flatten(), reduction="none") * mask).sum() / mask.sum()
            return loss, {"loss": loss.item()}
    ''',
    "toy_plugin/bigram/proposer.py": '''
        import torch

        from draftsmith.methods import DraftBatch, Proposer, load_head


        class BigramProposer(Proposer):
            def __init__(self, config, target, max_num_seqs, max_model_len):
                super().__init__(config, target, max_num_seqs, max_model_len)
                device = target.model.embed_tokens.weight.device
                self.head = load_head(config.model, device=device)
                self.tokens = torch.full((max_num_seqs, config.num_speculative_tokens), -1, dtype=torch.long,
                                         device=device)
                self.counts = torch.zeros(max_num_seqs, dtype=torch.long, device=device)

            def draft_models(self):
                return [self.head]

            @torch.inference_mode()
            def propose(self, rows, max_drafts, sampling=None, stop_below=0.0):
                tokens, counts = self.tokens[: len(rows)], self.counts[: len(rows)]
                tokens.fill_(-1)
                counts.copy_(torch.tensor(max_drafts))
                current = torch.tensor([r.all_token_ids()[-1] for r in rows], device=tokens.device)
                for step in range(max(max_drafts, default=0)):
                    current = self.head(current).argmax(-1)
                    tokens[:, step] = torch.where(step < counts, current, -1)
                return DraftBatch(tokens, counts, forwards=max(max_drafts, default=0))
    ''',
    "toy_plugin/bigram/convert.py": '''
        """The toy's foreign layout: config {"model_type": "toy_bigram_foreign", "vocab", "dim"}, tensors
        "emb" [vocab, dim] and "unemb" [dim, vocab]."""
        from draftsmith.methods.formats.registry import Exported, NormalizedHead, register_exporter, register_source

        FOREIGN = "toy_bigram_foreign"


        @register_source(FOREIGN, "toy low-rank bigram heads in their foreign layout")
        class ForeignBigram:
            @staticmethod
            def detect(checkpoint):
                return checkpoint.config.get("model_type") == FOREIGN

            @staticmethod
            def read(checkpoint, ctx):
                c, tensors = checkpoint.config, checkpoint.read(["emb", "unemb"])
                config = {"draftsmith_head_type": "toy_bigram", "vocab_size": c["vocab"], "rank": c["dim"],
                          "target_model": c.get("target", "")}
                return NormalizedHead(config, {"embed.weight": tensors["emb"],
                                               "out.weight": tensors["unemb"].T.contiguous()})


        @register_exporter("vllm", "toy_bigram")
        def to_foreign(head):
            c = head.config
            return Exported({"model_type": FOREIGN, "vocab": c["vocab_size"], "dim": c["rank"],
                             "target": c.get("target_model", "")},
                            {"emb": head.tensors["embed.weight"], "unemb": head.tensors["out.weight"].T.contiguous()})
    ''',
    "toy_plugin-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n",
    "toy_plugin-0.1.dist-info/entry_points.txt": "[draftsmith.methods]\ntoy_bigram = toy_plugin.bigram\n",
}

SERVE = """
import json, sys
from draftsmith.serve import LLM, SamplingParams
prompts, model, spec_config = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
params = SamplingParams(temperature=0, max_tokens=24)
def run(config):
    llm = LLM(model, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256, speculative_config=config)
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return ids, llm.get_metrics().get("num_draft_tokens", 0)
plain, _ = run(None)
spec, drafted = run(spec_config)
print(json.dumps({"plain": plain, "spec": spec, "drafted": drafted}))
"""


def _draftsmith(site: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-m", "draftsmith", *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, f"draftsmith {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_a_plugin_method_trains_converts_and_serves(tmp_path):
    site = tmp_path / "site"
    for name, text in PACKAGE.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(textwrap.dedent(text).lstrip())
    recipe = {"model": {"target": str(DEMO_MODEL), "head_type": "toy_bigram", "rank": 8},
              "data": {"train_files": [str(write_code_corpus(tmp_path / "corpus.jsonl", 16))], "format": "text",
                       "max_length": 64, "eval_fraction": 0.0},
              "training": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "batch_size": 2,
                           "save_dtype": "float32"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    assert "toy_bigram" in _draftsmith(site, "--help")  # found: the trainable methods `train` lists
    _draftsmith(site, "train", str(tmp_path / "recipe.yaml"), "--no-check")  # one step: a head that accepts little
    trained = tmp_path / "run" / "head"
    assert json.loads((trained / "config.json").read_text())["draftsmith_head_type"] == "toy_bigram"

    _draftsmith(site, "convert", str(trained), str(tmp_path / "foreign"), "--to", "vllm")
    assert json.loads((tmp_path / "foreign" / "config.json").read_text())["model_type"] == "toy_bigram_foreign"
    out = _draftsmith(site, "convert", str(tmp_path / "foreign"), str(tmp_path / "native"), "--to", "native")
    assert "detected toy_bigram_foreign" in out

    env = {**os.environ, "PYTHONPATH": str(site)}
    spec = json.dumps(spec_config("toy_bigram", tmp_path / "native", 3))
    served = subprocess.run([sys.executable, "-c", SERVE, json.dumps(CODE_PROMPTS[:2]), str(DEMO_MODEL), spec],
                            capture_output=True, text=True, env=env)
    assert served.returncode == 0, served.stderr[-3000:]
    result = json.loads(served.stdout.strip().splitlines()[-1])
    assert result["spec"] == result["plain"]
    assert result["drafted"] > 0


def test_a_plugin_that_fails_to_import_is_named_in_one_line(tmp_path):
    site = tmp_path / "site"
    (site / "broken_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "broken_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\n"
                                                                   "Version: 0.1\n")
    (site / "broken_plugin-0.1.dist-info" / "entry_points.txt").write_text("[draftsmith.methods]\n"
                                                                           "broken = broken_plugin.nowhere\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-m", "draftsmith", "train", "--help"], capture_output=True, text=True,
                          env=env)
    assert done.returncode != 0
    assert "method plugin 'broken' (from broken-plugin): importing broken_plugin.nowhere failed" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture(autouse=True)
def _no_stray_plugins():
    """The plugins above live in temp folders on the children's PYTHONPATH only: this process never sees them."""
    from draftsmith.methods import METHODS

    yield
    assert "toy_bigram" not in METHODS
