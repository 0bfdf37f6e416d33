"""Paths and tiny-checkpoint factories shared by the tests (importable: tests/ is on pythonpath)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from draftsmith.serve.speculation.cost_profile import ForwardCostTable

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "assets" / "demo-code-7m"
# code prompts ending mid-token or mid-line, for greedy-equality runs on the demo model (the `greedy_reference`
# fixture: 32 tokens each, 3 slots, so that rows join and leave a mixed batch)
CODE_PROMPTS = ["def add(a, b):\n    return a", "import os\n\n\ndef walk(root):\n    for dirpath, dirs, files in os.wa",
                "for i in ra", "class A:\n    def __init__(self):\n        self.x = 1\n        self.y"]
SHARED = Path(os.environ.get("DRAFTSMITH_SHARED", REPO.parent / "shared"))
# where the tests marked `cuda` run their kernels and engine steps: the GPU when there is one (`make gpu-check`
# proves them there), else the CPU, the kernels under Triton's interpreter (TRITON_INTERPRET=1)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_kernel_marks(module) -> list[pytest.MarkDecorator]:
    """The `pytestmark` of a test module whose tests run the kernels of `module` (importable without Triton):
    `slow`, and skips where they cannot run: Triton is not installed, or there is no GPU and kernels would
    need TRITON_INTERPRET=1 (`make test` sets it). Marks, not a module-level skip: the tests are still collected,
    so `pytest -m cuda --collect-only` counts them on any machine (`make gpu-check`'s dry run)."""
    no_interpreter = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    return [pytest.mark.slow,  # Triton's interpreter runs a kernel a program at a time, in Python
            pytest.mark.skipif(module.triton is None, reason="Triton is not installed"),
            pytest.mark.skipif(no_interpreter, reason="no GPU: Triton kernels run on CPU only under "
                                                      "TRITON_INTERPRET=1 (`make test` sets it)")]


def slot_kernel_or_skip():
    """The slot attention kernel module for one test, or a skip of that test: Triton is not installed, or there
    is no GPU and kernels would need TRITON_INTERPRET=1."""
    module = pytest.importorskip("draftsmith.models.slot_attention_triton")
    if module.triton is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET=1 (`make test` sets it)")
    return module


def panel_gemm_missing(without: str) -> str | None:
    """Why the C++ panel GEMM (models/panel_linear_cpu.cpp) cannot run here, None where it can; `without`: what
    runs instead, for the skip's reason."""
    from draftsmith.models import slot_attention_cpu

    error = slot_attention_cpu.build_error()
    if error is not None:
        return f"the CPU kernels did not build: {error}"
    if not torch.ops.draftsmith_cpu.panel_linear_available():
        return f"this CPU has no AVX-512: {without}"
    return None


def model_device(model) -> torch.device:
    """Where a loaded target's weights are."""
    return model.model.embed_tokens.weight.device


def greedy_token_ids(llm, prompts: list[str] = CODE_PROMPTS, max_tokens: int = 32) -> list[list[int]]:
    """`llm`'s greedy token ids for `prompts` (by default the `greedy_reference` fixture's run)."""
    from draftsmith.serve import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip: a user's fresh clone has no ../shared (CI does)."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: ../shared (house model, corpus) only exists in CI and the dev workspace")
    return path


# Tiny random configs per supported family (real values in comments where they differ a lot).
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,  # Llama-3-8B: 4096, 32
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "llama-bias-tied": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama3.1-rope": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral-window": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
}


def make_tiny_checkpoint(family: str, directory: Path, max_shard_size: str | None = None):
    """Saves a random HF model of `family` to `directory` and returns the HF model (fp32, eval)."""
    import transformers

    config_class, extra = TINY_FAMILIES[family]
    config = getattr(transformers, config_class)(**TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def make_tiny_target_with_tokenizer(directory: Path, num_layers: int = 4) -> Path:
    """A random Llama with the demo model's tokenizer (vocab 8192) and tiny width: a real target for training
    tests that runs in milliseconds."""
    import shutil

    import transformers

    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128,  # demo: 256, 768
                                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=True,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=3)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO_MODEL / name, directory / name)
    return directory


def write_code_corpus(path: Path, num_records: int = 48) -> Path:
    """Small, highly regular Python files: learnable in a few steps."""
    import json

    lines = []
    for i in range(num_records):
        body = "".join(f"def function_{i}_{j}(value):\n    return value + {j}\n\n\n" for j in range(6))
        lines.append(json.dumps({"path": f"f{i}.py", "text": body}))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_recipe(target: Path, data: Path, output: Path, head_type: str = "eagle3", **training) -> dict:
    recipe = {
        "model": {"target": str(target), "head_type": head_type},
        "data": {"train_files": [str(data)], "format": "text", "max_length": 64, "eval_fraction": 0.1},
        "training": {"output_dir": str(output), "epochs": 1, "batch_size": 4, "learning_rate": 3e-3,
                     "warmup_ratio": 0.0, "save_every_steps": 1000, "log_every_steps": 1,
                     "eval_max_k": 4, **training},
    }
    if head_type == "eagle3":
        recipe["model"].update(aux_layer_ids=[1, 2, 3], draft_vocab_size=512)
        recipe["training"].setdefault("ttt_length", 3)
    return recipe


def spec_config(method: str, model: str | Path | None = None, k: int | None = None, *, adaptive: bool = False,
                **keys) -> dict:
    """A `--speculative-config` dict for a test: `method`, its `model` and `k` (num_speculative_tokens; either
    omitted where None) and any other `keys`, under the fixed policy (every step drafts up to k) unless the test
    asks for `adaptive`, the product default, which drafts only where its cost model says drafting pays: on a
    slow or busy machine it may draft nothing, and a test that needs drafts would then prove nothing. The
    policy is always written, so the JSON of the dict handed to a server or CLI subprocess says it too."""
    config: dict = {"method": method}
    if model is not None:
        config["model"] = str(model)
    if k is not None:
        config["num_speculative_tokens"] = k
    return config | keys | {"adaptive": adaptive}


ROWS, QUERY_LENS = [1, 2, 4, 8], [1, 2, 3, 4, 5, 6, 8]


def synthetic_table(query_cost: float, unit: float = 1e-3) -> ForwardCostTable:
    """`unit` seconds per row for one query token, each further query token adding `query_cost` units per
    row: 0 makes verifying free; above 1 each verified token costs more than a decode, so speculation cannot
    pay even counting the host work a step saves (which is why EXPENSIVE's unit dwarfs this CPU's)."""
    seconds = [[r * (1 + query_cost * (q - 1)) * unit for q in QUERY_LENS] for r in ROWS]
    return ForwardCostTable({"model": "synthetic"}, ROWS, QUERY_LENS, 256, seconds)


def make_speculation_pay(llm):
    """Gives the adaptive policy a forward-cost table where verifying is free and a forward takes a second, so
    tests that need drafts to happen (lossless outputs, metrics that move) do not depend on how fast the
    machine running them is: the host and drafting work it still times live (milliseconds, more on a busy
    machine) cannot outweigh a second a token."""
    llm.engine.policy.cost.table = synthetic_table(0.0, unit=1.0)
    llm.engine.policy.cost.live_scaling = False


@dataclass
class Row:
    """What a proposer reads of a running request (`RowState`), for driving proposers without an engine."""

    request_id: str
    slot: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


def flattened_demo_copy(directory: Path, pard_token: int | None = None) -> Path:
    """The demo model with its final norm scaled down (a flatter readout): a draft model of the demo
    tokenizer that disagrees with the demo model enough for sampled drafts to matter. `pard_token`: written to
    its config.json, so that it serves with parallel_drafting (untrained for it: masks draft poorly)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, directory / name)
    if pard_token is not None:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "pard_token": pard_token}))
    tensors = load_file(str(DEMO_MODEL / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.4
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def greedy_acceptance_lengths(make_llm, configs: list[dict], greedy_reference: list[list[int]]) -> list[float]:
    """For each speculative config (keys for `make_llm(**keys)`): decodes CODE_PROMPTS greedily (32 tokens, the
    `greedy_reference` fixture's run), asserts the ids equal plain decoding's, and returns its mean acceptance
    length."""
    from draftsmith.serve import SamplingParams

    lengths = []
    for keys in configs:
        llm = make_llm(**keys)
        outputs = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == greedy_reference, keys
        lengths.append(llm.get_metrics()["mean_acceptance_length"])
    return lengths


def assert_samples_as_plain(target, llm) -> None:
    """Seeded sampled requests over CODE_PROMPTS give `llm` (speculating) exactly plain decoding's ids, with
    drafts accepted."""
    from draftsmith.serve import LLM, SamplingParams

    params = [SamplingParams(temperature=0.7, top_k=50, max_tokens=24, seed=10 + s) for s in range(len(CODE_PROMPTS))]
    plain = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256, target=target)
    want = [o.outputs[0].token_ids for o in plain.generate(CODE_PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS, params, use_tqdm=False)] == want
    assert llm.get_metrics()["num_accepted_tokens"] > 0


def random_mlp_speculator(directory: Path) -> str:
    """A random 4-stage MLP speculator for the demo target saved in `directory` (none ships: a trained one
    accepts too little on a 7M target to earn its place in the tree)."""
    from draftsmith.methods.mlp_speculator.head import MLPSpeculatorHead
    from draftsmith.models.head_configs import MLPSpeculatorConfig

    torch.manual_seed(2)
    config = MLPSpeculatorConfig(emb_dim=256, inner_dim=128, vocab_size=8192, n_predict=4, target_model="demo")
    MLPSpeculatorHead(config).save_pretrained(directory)
    return str(directory)


def recorded_draft_forwards(llm) -> list[int]:
    """A list that fills with the `forwards` of every DraftBatch `llm`'s proposer returns from now on."""
    seen, propose = [], llm.engine.proposer.propose

    def recording(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        seen.append(drafts.forwards)
        return drafts

    llm.engine.proposer.propose = recording
    return seen


def random_dflash_head(target, block_size=5, layers=2, seed=0, sample_from_anchor=False, dspark: dict | None = None,
                       window: int | None = None):
    """A DFlash head on `target` with weights drawn around 0 (norms around 1), fused layer ids 1, 3, 5; with
    `dspark` (DSparkConfig's own fields), a DSpark head (anchor-first) of those layers; `window`: its
    sliding_window."""
    from draftsmith.methods.dflash.head import DFlashConfig, DFlashHead
    from draftsmith.methods.dspark.head import DSparkConfig, DSparkHead

    t = target.config
    config_class, head_class = (DFlashConfig, DFlashHead) if dspark is None else (DSparkConfig, DSparkHead)
    extra = {} if dspark is None else {**dspark, "sample_from_anchor": True}
    config = config_class(**extra, hidden_size=t.hidden_size, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                          head_dim=t.head_dim, vocab_size=t.vocab_size, target_hidden_size=t.hidden_size,
                          target_num_layers=t.num_hidden_layers, aux_layer_ids=(1, 3, 5), block_size=block_size,
                          mask_token_id=3, rms_norm_eps=t.rms_norm_eps, rope=t.rope, sliding_window=window,
                          **({"sample_from_anchor": sample_from_anchor} if dspark is None else {}))
    torch.manual_seed(seed)
    head = head_class(config)
    for name, p in head.named_parameters():
        torch.nn.init.normal_(p, mean=1.0 if name.endswith("norm.weight") else 0.0, std=0.1)
    return head.attach_target(target).eval()


# the speculation every exactness test of request fields runs under (issue #41): a token-matching drafter, a
# sequential head, a block head and a tree; each a function, so that an import builds nothing
SPECULATORS = {
    "ngram": lambda: spec_config("ngram", k=3, prompt_lookup_max=3, prompt_lookup_min=1),
    "eagle3": lambda: spec_config("eagle3", DEMO_MODEL.parent / "demo-code-7m-eagle3", 4, draft_dtype="float32"),
    "dflash": lambda: spec_config("dflash", DEMO_MODEL.parent / "demo-code-7m-dflash", 7, draft_dtype="float32"),
    "eagle3 tree": lambda: spec_config("eagle3", DEMO_MODEL.parent / "demo-code-7m-eagle3", 8, draft_dtype="float32",
                                       tree_depth=4, tree_top_k=2),
}


def peagle_head(directory: Path, seed: int = 0, layers: int = 1, window: int | None = None) -> Path:
    """The shipped EAGLE-3 head made P-EAGLE (`parallel_drafting`, slot token 3) with a random `mask_hidden`,
    saved in `directory`: its first draft is the trained head's, its slots draft at random. With `layers` > 1
    the later layers are random too, small enough that the first draft still mostly stands; with `window`
    every layer attends over the newest that many positions."""
    from dataclasses import replace

    from draftsmith.methods import load_head

    sequential = load_head(DEMO_MODEL.parent / "demo-code-7m-eagle3")
    head = type(sequential)(replace(sequential.config, parallel_drafting=True, ptd_token_id=3,
                                    num_hidden_layers=layers, sliding_window=window))
    head.load_state_dict(sequential.state_dict(), strict=False)
    torch.manual_seed(seed)
    torch.nn.init.normal_(head.mask_hidden)
    with torch.no_grad():
        for name, param in head.layers.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * (0.01 if name.endswith(("o_proj.weight", "down_proj.weight"))
                                                        else 0.05))
    head.save_pretrained(directory)
    return directory


def dspark_head(target, directory: Path, seed: int = 0, markov_head_type: str = "vanilla") -> Path:
    """A random DSpark head (block 5, Markov rank 16) on `target`, saved in `directory`."""
    random_dflash_head(target, seed=seed, dspark={"markov_rank": 16, "markov_head_type": markov_head_type}
                       ).save_pretrained(directory)
    return directory
