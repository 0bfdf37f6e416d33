"""PARD (`draft_model` with `parallel_drafting`): the COD training layout shows every mask token exactly what
inference shows it, serving drafts k tokens in one draft forward with greedy equality, and PARD adaptation
trains and saves a checkpoint the engine serves."""

import json
import shutil

import pytest
import torch
import yaml

from draftsmith.errors import DraftsmithError
from draftsmith.methods.draft_model.head import IGNORE, cod_attention, cod_layout, kept_positions
from draftsmith.models.config import TargetConfig
from draftsmith.models.llama import CausalLM
from draftsmith.serve import LLM, SamplingParams
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import train
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    REPO,
    Row,
    make_tiny_target_with_tokenizer,
    recorded_draft_forwards,
    spec_config,
    tiny_recipe,
    write_code_corpus,
)

MASK = 3


def _tiny_lm():
    torch.manual_seed(0)
    cfg = TargetConfig.from_hf_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 128})
    model = CausalLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def test_every_kept_mask_keeps_its_chain():
    torch.manual_seed(1)
    kept = kept_positions(40, 6, retention=0.7, min_retention=0.2)
    assert kept[0].tolist() == list(range(40))
    for depth in range(1, len(kept)):
        assert len(kept[depth]) == int(40 * max(0.7**depth, 0.2))
        previous = set(kept[depth - 1].tolist())
        assert all(p - 1 in previous and p <= 38 for p in kept[depth].tolist())


def test_attention_mask_matches_the_inference_layout_rule():
    positions = torch.tensor([[0, 1, 2, 3, 2, 3, 3, 0]])
    depths = torch.tensor([[0, 0, 0, 0, 1, 1, 2, -1]])  # masks (1, 2), (1, 3), (2, 3); then padding
    allowed = cod_attention(positions, depths)[0, 0]
    # the depth-2 mask at 3 stands for "real 0..1, mask at 2, mask at 3": real 0, 1, the mask (1, 2), itself
    assert allowed[6].nonzero()[:, 0].tolist() == [0, 1, 4, 6]
    assert allowed[5].nonzero()[:, 0].tolist() == [0, 1, 2, 5]  # depth 1 at 3: real 0..2 and itself
    assert allowed[3].nonzero()[:, 0].tolist() == [0, 1, 2, 3]  # real tokens: causal
    assert allowed[7].nonzero()[:, 0].tolist() == [7] and not allowed[:7, 7].any()  # padding


def test_cod_forward_equals_inference_forward_for_every_kept_token():
    """One packed training forward gives each mask token the logits the draft computes at inference for the
    same context (its chain's real tokens, then that many masks, plainly causal): the layout trains what
    is served."""
    lm = _tiny_lm()
    ids = torch.randint(4, 64, (2, 12))
    lengths = [12, 9]
    loss_mask = torch.ones(2, 12, dtype=torch.long)
    torch.manual_seed(0)
    layout = cod_layout(ids, lengths, loss_mask, MASK, depths=4, retention=0.8, min_retention=0.3)
    with torch.no_grad():
        packed = lm(layout.input_ids, positions=layout.positions, attention_mask=layout.attention_mask).logits
        checked = 0
        for b, length in enumerate(lengths):
            for t in range(layout.input_ids.shape[1]):
                depth, pos = int(layout.depths[b, t]), int(layout.positions[b, t])
                if depth < 0:
                    continue
                anchor = pos - depth
                context = torch.cat([ids[b, : anchor + 1], torch.full((depth,), MASK)])[None]
                torch.testing.assert_close(packed[b, t], lm(context).logits[0, -1], atol=1e-4, rtol=1e-4)
                want = ids[b, pos + 1] if pos + 1 < length else IGNORE
                assert int(layout.labels[b, t]) == int(want)
                checked += depth > 0
    assert checked >= 10


def _pard_copy(directory, pard_token=MASK):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(DEMO_MODEL / name, directory / name)
    config = json.loads((directory / "config.json").read_text())
    if pard_token is not None:
        config["pard_token"] = pard_token
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _serve(draft, k=4, **extra):
    return LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
               speculative_config=spec_config("draft_model", draft, k, parallel_drafting=True, **extra))


def test_parallel_drafts_decode_with_greedy_equality_in_one_draft_forward(tmp_path, greedy_reference):
    """The demo model as its own (un-adapted) parallel draft: draft 1 comes from the last real token, so it is
    the target's own choice and nearly always accepted; mixed batch (4 prompts, 3 slots)."""
    llm = _serve(_pard_copy(tmp_path))
    proposer = llm.engine.proposer
    assert proposer.per_token_drafts is False
    forwards = recorded_draft_forwards(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    metrics = llm.get_metrics()
    assert metrics["num_accepted_tokens"] >= 0.9 * metrics["num_drafts"] > 0  # draft 1 of every step
    assert max(forwards) == 1


def test_adaptive_parallel_drafting_keeps_greedy_equality(tmp_path, greedy_reference):
    from helpers import make_speculation_pay

    llm = _serve(_pard_copy(tmp_path), adaptive=True)
    make_speculation_pay(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_drafts"] > 0


def test_a_draft_without_a_mask_token_is_one_line(tmp_path):
    with pytest.raises(DraftsmithError, match=r"parallel_drafting needs a PARD draft.*names no mask token"):
        _serve(_pard_copy(tmp_path, pard_token=None))
    with pytest.raises(DraftsmithError, match="mask token 9000 is outside its vocabulary of 8192"):
        _serve(_pard_copy(tmp_path, pard_token=9000))


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("pard")
    target = make_tiny_target_with_tokenizer(root / "target")
    data = write_code_corpus(root / "code.jsonl")
    raw = tiny_recipe(target, data, root / "run", "draft_model", epochs=6, parallel_draft_tokens=4,
                      learning_rate=1e-2)
    raw["model"]["draft"] = str(target)  # the tiny target adapted as its own parallel draft
    return root, target, validate_recipe(raw), train(validate_recipe(raw), ["test"])


@pytest.mark.slow
def test_adaptation_learns_the_masks_and_saves_an_hf_checkpoint_that_serves(adapted):
    root, target, recipe, final = adapted
    log = [json.loads(line) for line in (root / "run" / "train_log.jsonl").read_text().splitlines()]
    first, last = log[:5], log[-5:]
    deep = lambda rows: sum(r["top1_depth2"] for r in rows) / len(rows)  # noqa: E731
    assert deep(last) > deep(first) + 0.1, [r["top1_depth2"] for r in log]
    report = json.loads((root / "run" / "eval_epoch6.json").read_text())
    assert report["sim_accept_pos2"] > 0, report  # the second draft, from a mask, is accepted sometimes
    config = json.loads((final / "config.json").read_text())
    assert config["pard_token"] == 3 and config["vocab_size"] == 8192  # the pad token, vLLM's equal vocab
    assert config["draftsmith_parallel_draft_tokens"] == 4  # the recipe's K: serving refuses more (below)
    assert (final / "tokenizer.json").is_file()
    with pytest.raises(DraftsmithError, match=r"num_speculative_tokens 5: .* was adapted to draft 4 tokens in one forward"):
        LLM(target, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128,
            speculative_config={"method": "draft_model", "model": str(final), "num_speculative_tokens": 5,
                                "parallel_drafting": True})
    llm = LLM(target, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128,
              speculative_config=spec_config("draft_model", final, 3, parallel_drafting=True))
    plain = LLM(target, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=128)
    forwards = recorded_draft_forwards(llm)
    params = SamplingParams(temperature=0, max_tokens=16)
    assert [o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS[:3], params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in plain.generate(CODE_PROMPTS[:3], params, use_tqdm=False)]
    # it drafted from the saved checkpoint, all k in one forward (a tiny random target's greedy text is not the
    # corpus the draft adapted to, so acceptance is not asked here: the eval above and the shipped draft are)
    assert llm.get_metrics()["num_draft_tokens"] > 0 and max(forwards) == 1


def test_draft_model_recipes_refuse_head_keys():
    raw = yaml.safe_load((REPO / "recipes" / "pard-house.yaml").read_text())
    raw["model"]["aux_layer_ids"] = [1, 2]
    with pytest.raises(DraftsmithError, match="a draft model is a whole LM, adapted as it is: drop aux_layer_ids"):
        validate_recipe(raw)


def test_parallel_drafts_are_the_uncached_forward_over_masks_step_after_step():
    """The shipped PARD draft's drafts from its cache equal an uncached forward over [every token, k - 1 masks],
    over steps that accept part of the drafts: the masks' keys and values, written past the row's tokens, never
    leak into a later step."""
    from draftsmith.methods.draft_model.proposer import DraftModelProposer
    from draftsmith.models import load_target
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.serve.speculation.config import parse_speculative_config

    target = load_target(DEMO_MODEL, dtype="float32")
    config = parse_speculative_config({"method": "draft_model", "model": str(SHIPPED), "num_speculative_tokens": 4,
                                       "parallel_drafting": True, "draft_dtype": "float32"})
    proposer = DraftModelProposer(config, target, 2, 256)
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[0], add_special_tokens=False).input_ids
    row = Row("a", 1, prompt, [int(target(torch.tensor([prompt])).logits[0, -1].argmax())])
    accepted = 0
    for step in range(4):
        drafts = proposer.propose([row], [4]).tokens[0].tolist()
        with torch.no_grad():
            logits = proposer.draft(torch.tensor([row.all_token_ids() + [MASK] * 3])).logits[0, -4:]
        assert drafts == logits.argmax(-1).tolist()
        keep = step % 3  # 0, 1 or 2 drafts accepted, then a token that is not the next draft
        accepted += keep
        row.output_token_ids += drafts[:keep] + [(drafts[keep] + 1) % 8000 + 4]
    assert accepted == 3


SHIPPED = REPO / "assets" / "demo-code-7m-pard"
