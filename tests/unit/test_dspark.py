"""DSpark (issue #42): the DFlash block with the Markov term along it and a confidence head whose survival
chances cut each row's verify. Served blocks are the taught ones, decoding stays lossless with and without
the cut, and the cut is the one the cost model prefers."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head
from draftsmith.methods.dflash.objective import sample_anchors
from draftsmith.methods.dspark.objective import block_outputs, dspark_objective
from draftsmith.methods.dspark.proposer import DSparkProposer
from draftsmith.methods.proposer_base import DraftBatch
from draftsmith.models import load_target
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config
from draftsmith.serve.speculation.verify_length import size_chains
from draftsmith.train.objectives import target_features
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import train
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    REPO,
    Row,
    random_dflash_head,
    spec_config,
    tiny_recipe,
    write_code_corpus,
)

DSPARK = {"markov_rank": 16}


@pytest.fixture(scope="module")
def demo_target():
    return load_target(DEMO_MODEL, dtype="float32")


def _head(target, seed=0, window=None, **fields):
    head = random_dflash_head(target, block_size=5, seed=seed, dspark={**DSPARK, **fields}, window=window)
    with torch.no_grad():  # a Markov term large enough to change drafts
        head.markov_head.markov_w1.weight.normal_(std=1.0)
        head.markov_head.markov_w2.weight.normal_(std=1.0)
        if head.markov_head.gated:  # gates that differ by position and token, far from a constant
            head.markov_head.gate_proj.weight.normal_(std=0.1)
    return head


def _serve(head_dir, k=5, engine: dict | None = None, **extra):
    engine = {"dtype": "float32", "device": "cpu", "max_num_seqs": 3, "max_model_len": 256, **(engine or {})}
    return LLM(DEMO_MODEL, speculative_config=spec_config("dspark", head_dir, k, draft_dtype="float32", **extra),
               **engine)


@pytest.mark.parametrize("markov_head_type,window", [("vanilla", None), ("gated", None), ("vanilla", 8)])
def test_served_drafts_are_the_taught_block_with_the_markov_term_along_it(demo_target, tmp_path, markov_head_type,
                                                                          window):
    """The proposer's drafts equal the teacher-forced block's greedy choices wherever the drafts before them
    are the text (here: the text is made of the drafts), and its survival chances are the running product of
    the confidence head's, which the Markov term of each previous draft feeds. A gated head's term reads each
    position's hidden state: a proposer gating by another position's fails this. A windowed head (fed, as the
    engine feeds it, only the prompt's newest `window` positions) drafts the windowed teacher-forced block."""
    head = _head(demo_target, markov_head_type=markov_head_type, window=window)
    head.save_pretrained(tmp_path / "head")
    config = parse_speculative_config({"method": "dspark", "model": str(tmp_path / "head"),
                                       "num_speculative_tokens": 5, "draft_dtype": "float32"})
    proposer = DSparkProposer(config, demo_target, 1, 128)
    head, ids = proposer.head, torch.randint(4, 8000, (1, 20))
    with torch.no_grad():
        out = demo_target(ids, feature_layers=head.feature_layers)
        features = head.features(out.hidden_states)
    fed = 19 if window is None else window
    proposer.observe([Row("a", 0, ids[0, :19].tolist(), [])], [19 - fed], [fed], features[:, 19 - fed : 19])
    drafted = proposer.propose([Row("a", 0, ids[0, :19].tolist(), [int(ids[0, 19])])], [5])
    drafts = drafted.tokens[0].tolist()
    # the text the drafts continue: the block's own choices, so teacher forcing reads the drafts
    text = torch.cat([ids, torch.tensor([drafts])], 1)
    batch = {"input_ids": text, "lengths": torch.tensor([25]), "loss_mask": torch.ones_like(text)}
    with torch.no_grad():
        feats = target_features(demo_target, head.feature_layers, text, "float32")
        logits, hidden, embedded, _, _, _ = block_outputs(head, demo_target, batch, feats, torch.tensor([[19]]), 5)
        chances = torch.sigmoid(head.confidence_logits(hidden, embedded))[0, 0]
    assert drafts == logits.argmax(-1)[0, 0].tolist()
    without_markov = head.readout(hidden).argmax(-1)[0, 0].tolist()
    assert drafts != without_markov  # the Markov term changed them: the check above is not DFlash's
    torch.testing.assert_close(drafted.confidence[0], chances.cumprod(0), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated"])
def test_greedy_equality_alone_and_in_mixed_batches(demo_target, tmp_path, greedy_reference, markov_head_type):
    _head(demo_target, seed=1, markov_head_type=markov_head_type).save_pretrained(tmp_path / "head")
    llm = _serve(tmp_path / "head")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0
    one = llm.generate(CODE_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert one[0].outputs[0].token_ids == greedy_reference[0]


def test_the_confidence_cut_keeps_greedy_equality_and_cuts(demo_target, tmp_path, greedy_reference):
    """Adaptive, with a cost model under which drafting pays: rows verify the prefixes the survival chances
    and the cost model choose, fewer than drafted, and the output is the target's own. The policy learns from
    every draft drafted, a cut one as not accepted: the cut's confident prefixes alone would tell it that a
    plan yields more than it does."""
    from helpers import synthetic_table

    _head(demo_target, seed=2).save_pretrained(tmp_path / "head")
    llm = _serve(tmp_path / "head", adaptive=True)
    # each verified draft costs 30% of a token's forward, and a forward a second a row: the step's real drafting
    # and host time are noise beside it, so the cut does not depend on this machine's speed
    llm.engine.policy.cost.table = synthetic_table(0.3, unit=1.0)
    llm.engine.policy.cost.live_scaling = False
    cuts = []
    real = llm.engine.proposer.propose

    def recorded(*args, **kwargs):
        drafts = real(*args, **kwargs)
        cuts.append(drafts.counts.clone())
        return drafts

    llm.engine.proposer.propose = recorded
    learned = []  # the drafts the policy learns acceptance from: all that were drafted, the cut ones rejected
    observe = llm.engine.policy.observe
    llm.engine.policy.observe = lambda slots, num_draft, accepted: (learned.append(sum(num_draft)),
                                                                      observe(slots, num_draft, accepted))
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    verified, drafted = llm.get_metrics()["num_draft_tokens"], sum(int(c.sum()) for c in cuts)
    assert cuts and verified < drafted  # the cut ran after drafting
    assert sum(learned) == drafted


def test_without_adaptive_verification_no_chances_go_back(demo_target, tmp_path):
    _head(demo_target).save_pretrained(tmp_path / "head")
    config = parse_speculative_config({"method": "dspark", "model": str(tmp_path / "head"), "num_speculative_tokens": 3,
                                       "enable_adaptive_verification": False})
    assert DSparkProposer(config, demo_target, 1, 64).adaptive_verification is False
    with pytest.raises(DraftsmithError, match="tree_depth: Extra inputs are not permitted"):
        parse_speculative_config({"method": "dspark", "model": "x", "num_speculative_tokens": 3, "tree_depth": 2})


class _Cost:
    """A verify of mean query length q at r rows costs r * (1 + 0.3 (q - 1)) units (each draft verified adds
    30% of a token's forward), plus a fixed host cost."""

    def forward(self, rows, query_len):
        return rows * (1 + 0.3 * (query_len - 1))

    def host(self, rows, speculative):
        return 0.5


def _best_by_brute_force(survival, limits, cost, sunk):
    rows = len(limits)
    best, best_rate = None, -1.0
    for cut in itertools.product(*(range(n + 1) for n in limits)):
        gained = sum(float(survival[b, :c].sum()) for b, c in enumerate(cut))
        seconds = sunk + cost.forward(rows, 1 + sum(cut) / rows) + cost.host(rows, sum(cut) > 0)
        if (rows + gained) / seconds > best_rate + 1e-12:
            best, best_rate = list(cut), (rows + gained) / seconds
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_cut_is_the_best_one_the_cost_model_knows(seed):
    """Against every combination of per-row prefixes, on random survival curves: the per-row cut the engine
    takes has the highest expected tokens per second."""
    generator = torch.Generator().manual_seed(seed)
    rows, k = 3, 4
    chances = torch.rand(rows, k, generator=generator) ** 0.5
    survival = chances.cumprod(-1)
    limits = torch.randint(1, k + 1, (rows,), generator=generator)
    survival = torch.where(torch.arange(k) < limits[:, None], survival, 0.0)
    drafts = DraftBatch(torch.zeros(rows, k, dtype=torch.long), limits.clone(), confidence=survival)
    cut = size_chains(drafts, rows, _Cost(), 0.2)
    assert cut == _best_by_brute_force(survival, limits.tolist(), _Cost(), 0.2)
    assert drafts.counts.tolist() == cut


def test_a_busy_batch_verifies_less_than_one_row_alone():
    """The same survival curve: alone a row keeps more of its drafts than each of 8 rows does when the verify
    of every draft costs more (a busier forward)."""

    class Busy(_Cost):
        def forward(self, rows, query_len):
            return rows * (1 + (0.15 if rows == 1 else 0.6) * (query_len - 1))

    curve = torch.tensor([0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1])
    alone = size_chains(DraftBatch(torch.zeros(1, 7, dtype=torch.long), torch.tensor([7]), confidence=curve[None]),
                        1, Busy(), 0.1)
    busy = size_chains(DraftBatch(torch.zeros(8, 7, dtype=torch.long), torch.full((8,), 7),
                                  confidence=curve.expand(8, -1).clone()), 8, Busy(), 0.1)
    assert alone[0] > max(busy)


def test_config_rules_are_one_line(demo_target, tmp_path):
    from draftsmith.methods.dspark.head import DSparkConfig

    data = _head(demo_target).config.to_json()
    with pytest.raises(DraftsmithError, match="a DSpark head is anchor-first"):
        DSparkConfig.from_json({**data, "sample_from_anchor": False})
    with pytest.raises(DraftsmithError, match="confidence_head_with_markov needs a Markov head"):
        DSparkConfig.from_json({**data, "markov_rank": 0})
    with pytest.raises(DraftsmithError, match="markov_head_type 'rnn': one of vanilla, gated"):
        DSparkConfig.from_json({**data, "markov_head_type": "rnn"})
    head = _head(demo_target)
    head.save_pretrained(tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    assert loaded.head_type == "dspark" and loaded.config.markov_rank == 16
    with pytest.raises(DraftsmithError, match="drafts at most 5 tokens a step"):
        _serve(tmp_path / "head", k=6)


@pytest.mark.slow
def test_training_learns_drafts_and_their_chances(tmp_path):
    """On the demo target and a regular corpus: the loss falls, first drafts agree more with the target, and
    the confidence head's mean chance at the first position tracks how often that draft is right."""
    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(DEMO_MODEL, data, tmp_path / "run", "dspark", epochs=4, num_anchors=8, learning_rate=1e-3)
    raw["model"].update(block_size=4, markov_rank=32)
    final = train(validate_recipe(raw), ["test"])
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(log[-5:], "loss") < mean(log[:5], "loss")
    assert mean(log[-5:], "acc_pos1") > mean(log[:5], "acc_pos1") + 0.15, [r["acc_pos1"] for r in log]
    assert abs(mean(log[-10:], "conf_pos1") - mean(log[-10:], "acc_pos1")) < 0.15
    head = load_head(final)
    assert head.head_type == "dspark" and head.config.block_size == 4 and head.config.markov_rank == 32
    report = json.loads((tmp_path / "run" / "eval_epoch4.json").read_text())
    assert report["sim_mean_acceptance_length_k1"] > 1.0 and report["sim_served_acceptance_length"] > 1.0, report


def _loss(head, target, batch, feats, **weights):
    cfg = SimpleNamespace(ce_weight=0.0, tv_weight=0.0, kd_weight=0.0, confidence_weight=0.0,
                          confidence_label="match", loss_positions=None, loss_decay_gamma=1.5, num_anchors=3)
    for name, value in weights.items():
        setattr(cfg, name, value)
    torch.manual_seed(0)  # the same anchors for every call
    with torch.no_grad():
        return dspark_objective(head, target, batch, feats, cfg)[0]


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated"])
def test_each_loss_term_is_what_its_weight_names(demo_target, markov_head_type):
    """The objective is the weighted sum of its terms, and kd_weight's is the cross-entropy against the
    target's whole distribution at the block positions trained, weighted as the others. The kd term runs
    fused with the Markov GEMM, the others through the block's logits: a gated head's fused term gated
    otherwise than its logits fails the comparison."""
    head, ids = _head(demo_target, markov_head_type=markov_head_type), torch.randint(4, 8000, (1, 24))
    batch = {"input_ids": ids, "lengths": torch.tensor([24]), "loss_mask": torch.ones_like(ids)}
    feats = target_features(demo_target, head.feature_layers, ids, "float32")
    kd, ce, tv = (_loss(head, demo_target, batch, feats, **{name: 1.0}) for name in ("kd_weight", "ce_weight",
                                                                                     "tv_weight"))
    mixed = _loss(head, demo_target, batch, feats, kd_weight=0.5, ce_weight=0.1, tv_weight=0.9)
    torch.testing.assert_close(mixed, 0.5 * kd + 0.1 * ce + 0.9 * tv)
    torch.manual_seed(0)
    anchors, _ = sample_anchors(batch["loss_mask"], [24], 3, "cpu")
    with torch.no_grad():
        logits, _, _, target_logits, _, real = block_outputs(head, demo_target, batch, feats, anchors, 5)
    soft = -(torch.softmax(target_logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    weights = torch.exp(-torch.arange(5.0) / 1.5) * real  # a block's positions past the text are not trained
    torch.testing.assert_close(kd, (soft * weights).sum() / weights.sum())
    assert not torch.isclose(kd, ce)  # the whole distribution, not the greedy token's cross-entropy


def test_a_recipe_whose_drafts_learn_nothing_is_one_line():
    from draftsmith.train.recipe import load_recipe

    with pytest.raises(DraftsmithError, match="ce_weight, tv_weight and kd_weight are all 0"):
        load_recipe(REPO / "recipes/dspark-demo.yaml", ["training.kd_weight=0"])
    assert load_recipe(REPO / "recipes/dspark-demo.yaml", ["training.kd_weight=0", "training.ce_weight=0.1",
                                                    "training.tv_weight=0.9"]).training.tv_weight == 0.9


def test_a_recipe_names_the_markov_head_it_trains():
    from draftsmith.methods.dspark import DSparkMethod
    from draftsmith.train.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes/dspark-demo.yaml", ["model.markov_head_type=gated"])
    assert DSparkMethod.head_fields(recipe.model)["markov_head_type"] == "gated"
    assert DSparkMethod.head_fields(load_recipe(REPO / "recipes/dspark-demo.yaml", []).model)["markov_head_type"] == \
        "vanilla"
    with pytest.raises(DraftsmithError, match="markov_head_type"):
        load_recipe(REPO / "recipes/dspark-demo.yaml", ["model.markov_head_type=rnn"])


def test_no_drafts_chosen_is_a_plain_step():
    drafts = DraftBatch(torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 3]),
                        confidence=torch.full((2, 3), 1e-4))
    assert size_chains(drafts, 2, SimpleNamespace(forward=lambda r, q: r * q, host=lambda r, s: 0.0), 0.0) == [0, 0]


def _deepspec_checkpoint(head, directory, **extra):
    """A head written as DeepSpec saves DSpark drafts: a flat Qwen3 config with its keys, bare tensor names and
    copies of the target's embedding and LM head."""
    from safetensors.torch import save_file

    c = head.config
    directory.mkdir(parents=True)
    config = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope.theta,
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
              "block_size": c.block_size, "num_target_layers": c.target_num_layers, "mask_token_id": c.mask_token_id,
              "target_layer_ids": [0, 2, 4], "markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
              "enable_confidence_head": True, "confidence_head_with_markov": True, "num_anchors": 512, **extra}
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in head.state_dict().items()}
    target = head.target
    tensors |= {"embed_tokens.weight": target.model.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
    save_file({k: v.detach().clone() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated"])
def test_a_deepspec_checkpoint_converts_and_decodes_losslessly(demo_target, tmp_path, greedy_reference,
                                                               markov_head_type):
    import public_checkpoints as pub

    head = _head(demo_target, seed=5, markov_head_type=markov_head_type)
    _deepspec_checkpoint(head, tmp_path / "deepspec")
    assert pub.convert(tmp_path / "deepspec", tmp_path / "native", "--target", str(DEMO_MODEL)) == 0
    config, tensors = pub.read_native(tmp_path / "native")
    assert config["draftsmith_head_type"] == "dspark" and config["aux_layer_ids"] == [1, 3, 5]
    assert config["sample_from_anchor"] is True and config["markov_rank"] == 16
    assert config["markov_head_type"] == markov_head_type
    assert tensors.keys() == head.state_dict().keys()
    assert all(torch.equal(tensors[k], v) for k, v in head.state_dict().items())
    llm = _serve(tmp_path / "native")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference


@pytest.mark.parametrize("to, markov_head_type", [("vllm", "vanilla"), ("speculators", "vanilla"),
                                                   ("vllm", "gated"), ("speculators", "gated")])
def test_round_trips_are_lossless(demo_target, tmp_path, to, markov_head_type, capsys):
    import public_checkpoints as pub

    head = _head(demo_target, seed=3, markov_head_type=markov_head_type)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(tmp_path / "native")
    config, tensors = pub.read_native(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / to, "--to", to) == 0
    exported = json.loads((tmp_path / to / "config.json").read_text())
    if to == "vllm":  # DeepSpec's layout, which vLLM's Qwen3DSparkForCausalLM loads
        assert exported["architectures"] == ["Qwen3DSparkModel"] and exported["target_layer_ids"] == [0, 2, 4]
    else:
        assert exported["speculators_model_type"] == "dspark" and exported["aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert exported["sample_from_anchor"] is True
        assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert exported["markov_rank"] == 16 and exported["enable_confidence_head"] is True
    assert exported["markov_head_type"] == markov_head_type
    if to == "vllm":  # vLLM 0.32 refuses any DSpark head but a vanilla one: the export says so
        said = capsys.readouterr()
        assert ("serves DSpark heads of markov_head_type 'vanilla' only" in said.out + said.err) == \
            (markov_head_type == "gated")
    assert pub.convert(tmp_path / to, tmp_path / "back") == 0
    config_back, tensors_back = pub.read_native(tmp_path / "back")
    assert config_back == config and tensors_back.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors_back[k]) for k in tensors)


def test_a_speculators_checkpoint_with_a_smaller_draft_vocabulary_is_one_line(demo_target, tmp_path, capsys):
    """DFlash's speculators reader reads DSpark's too, and says which head it refused."""
    import public_checkpoints as pub

    head = _head(demo_target, seed=3)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / "speculators", "--to", "speculators") == 0
    config_path = tmp_path / "speculators" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "draft_vocab_size": 4096}))
    capsys.readouterr()
    assert pub.convert(tmp_path / "speculators", tmp_path / "back") != 0
    assert "draft_vocab_size 4096 of 8192: draftsmith's DSpark head reads out" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    ({"markov_head_type": "rnn"}, "markov_head_type 'rnn'"),
    ({"sample_from_anchor": False}, "sample_from_anchor false: a DSpark head drafts anchor-first"),
])
def test_layouts_draftsmith_does_not_run_are_one_line(demo_target, tmp_path, capsys, change, message):
    import public_checkpoints as pub

    _deepspec_checkpoint(_head(demo_target), tmp_path / "deepspec", **change)
    assert pub.convert(tmp_path / "deepspec", tmp_path / "native", "--target", str(DEMO_MODEL)) != 0
    assert message in capsys.readouterr().err


def test_kept_markov_bias_rows_are_the_products_whatever_was_evicted():
    """`add_to` adds each token's bias row to logits in place (a lone row's kept row as it lies, several
    gathered, more than the budget holds computed): the products, whatever was kept or evicted."""
    from draftsmith.methods.dspark.markov_cache import MarkovBiasRows

    torch.manual_seed(0)
    w1, w2 = torch.randn(50, 4), torch.randn(50, 4)
    rows = MarkovBiasRows(w1, w2, budget_bytes=3 * 50 * 4)  # room for 3 tokens' rows
    assert rows.capacity == 3
    for tokens in ([7], [7, 9], [9, 11, 7], [12, 7], [13, 14], [7, 7, 9], [1, 2, 3, 4], [4, 4]):
        t = torch.tensor(tokens)
        logits = torch.randn(len(tokens), 50)
        expected = logits + w1[t] @ w2.t()
        assert rows.add_to(logits, t) is logits
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
        assert len(rows.where) <= 3
    assert list(rows.where) == [7, 9, 4]  # least recently used first; [1, 2, 3, 4] kept nothing
