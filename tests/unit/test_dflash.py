"""DFlash: the teacher-forced training layout computes what serving computes from its cache, serving is
lossless (fp32, mixed batch) with one draft forward a step, bad configs are one-line errors, and training
learns the target's next tokens."""

import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import DraftsmithError
from draftsmith.methods import load_head
from draftsmith.methods.dflash.head import DFlashConfig
from draftsmith.models import load_target
from draftsmith.models.attention import cached_attention
from draftsmith.models.kv_cache import ForwardBatch
from draftsmith.models.rope import apply_rope
from draftsmith.serve import LLM, SamplingParams
from draftsmith.serve.speculation.config import parse_speculative_config
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.trainer import train
from helpers import (
    CODE_PROMPTS,
    DEMO_MODEL,
    REPO,
    random_dflash_head,
    recorded_draft_forwards,
    spec_config,
    tiny_recipe,
    write_code_corpus,
)

SHIPPED = REPO / "assets" / "demo-code-7m-dflash"


@pytest.fixture(scope="module")
def demo_target():
    return load_target(DEMO_MODEL, dtype="float32")


def test_training_blocks_equal_blocks_drafted_from_the_cache(demo_target):
    """A block from anchor a in one teacher-forced forward over the whole sequence equals the block the
    proposer's way computes: context keys and values of positions < a written to the cache, then the block
    attending over them and over itself."""
    head = random_dflash_head(demo_target)
    ids = torch.randint(4, 8000, (1, 24))
    with torch.no_grad():
        out = demo_target(ids, feature_layers=head.feature_layers)
        features = head.features(out.hidden_states)
        anchors = torch.tensor([[5, 13, 17]])
        taught = head.training_forward(features, ids, anchors).view(1, 3, 5, -1)
        cache = head.make_cache(1, 64)
        for n, a in enumerate(anchors[0].tolist()):
            context = ForwardBatch.build([0], [0], [a], cache, None, "cpu")
            for layer, (k, v) in enumerate(head.context_kv(features[:, :a], context.positions)):
                context.write(cache.k[layer], k)
                context.write(cache.v[layer], v)
            block = ForwardBatch.build([0], [a], [5], cache, None, "cpu")
            keys = torch.arange(block.kv_start, block.kv_len)
            mask = (keys <= a + 4)[None, None, None, :].expand(1, 1, 5, -1)

            def attend(layer, q, k, v, block=block, mask=mask):
                block.write(cache.k[layer], k)
                block.write(cache.v[layer], v)
                return cached_attention(q, block.read(cache.k[layer]), block.read(cache.v[layer]), mask)

            served = head.block_forward(head.embed_block(ids[:, a : a + 1]), block.positions, attend)
            torch.testing.assert_close(taught[0, n], served[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers", [1, 2])
def test_serving_shortcuts_compute_what_the_plain_layers_do(demo_target, layers):
    """The context keys and values from one fused projection of every layer (oneDNN at inference) equal each
    layer's own k/v projections, and a block whose last layer runs only positions 1..3 gives those positions
    of the whole block's forward."""
    head = random_dflash_head(demo_target, layers=layers)
    features = torch.randn(2, 7, 3 * demo_target.config.hidden_size)
    positions = torch.arange(7).expand(2, -1)
    with torch.inference_mode():
        got = head.context_kv(features, positions)
        context = head.hidden_norm(head.fc(features))
        cos, sin = head.rope(positions, context.dtype)
        for layer, (k, v) in zip(head.layers, got):
            attn = layer.self_attn
            want_k = attn.k_norm(F.linear(context, attn.k_proj.weight).view(2, 7, -1, head.config.head_dim))
            want_v = F.linear(context, attn.v_proj.weight).view(2, 7, -1, head.config.head_dim)
            torch.testing.assert_close(k, apply_rope(want_k.transpose(1, 2), cos, sin), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, want_v.transpose(1, 2), atol=1e-5, rtol=1e-5)

        block = head.embed_block(torch.tensor([[17], [230]]))
        block_positions = torch.arange(7, 12).expand(2, -1)
        context_kv = head.context_kv(features, positions)

        def attend(i, q, k, v):
            keys, values = context_kv[i]
            return F.scaled_dot_product_attention(
                q, torch.cat([keys, k], 2), torch.cat([values, v], 2), enable_gqa=True)

        whole = head.block_forward(block, block_positions, attend)
        part = head.block_forward(block, block_positions, attend, outputs=slice(1, 4))
    assert part.shape == (2, 3, head.config.hidden_size)
    torch.testing.assert_close(part, whole[:, 1:4], atol=1e-5, rtol=1e-5)


def _save(head, directory):
    head.save_pretrained(directory)
    return directory


def _serve(head_dir, k=4, engine: dict | None = None, **extra):
    """An engine drafting with the DFlash head in `head_dir`; `engine`: LLM arguments over the defaults (a
    device, a target to share)."""
    engine = {"dtype": "float32", "device": "cpu", "max_num_seqs": 3, "max_model_len": 256, **(engine or {})}
    return LLM(DEMO_MODEL, speculative_config=spec_config("dflash", head_dir, k, draft_dtype="float32", **extra), **engine)


@pytest.mark.slow
def test_a_random_head_decodes_with_greedy_equality_one_draft_forward_a_step(demo_target, tmp_path, greedy_reference):
    llm = _serve(_save(random_dflash_head(demo_target), tmp_path / "head"))
    forwards = recorded_draft_forwards(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert max(forwards) == 1 and llm.engine.proposer.per_token_drafts is False


def test_adaptive_dflash_keeps_greedy_equality(demo_target, tmp_path, greedy_reference):
    from helpers import make_speculation_pay

    llm = _serve(_save(random_dflash_head(demo_target, seed=1), tmp_path / "head"), adaptive=True)
    cost = llm.engine.policy.cost  # a draft step priced as timed at 1 and 2 rows (within 3 slots), a ratio of 1
    assert cost.draft_guess == 1.0 and cost.draft_table.rows == [1, 2]
    assert all(line[0] > 0 for line in cost.draft_table.seconds)
    # catch-ups priced by timing the projection they run, within 3 slots and the 256 + 5 positions of the cache
    assert cost.catch_up_table.rows == [1, 2] and cost.catch_up_table.query_lens == [1, 8, 32, 128]
    make_speculation_pay(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    # the timers' scratch writes and drafts went into slots before any request: every context was written over
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0  # the adaptive policy did speculate


def test_the_catch_up_timer_runs_the_projection_a_catch_up_runs(demo_target, monkeypatch):
    """A catch-up is `_write_context` over kept positions and nothing else (no block forward): the timer runs
    that, for the rows and positions asked, from position 0 of the first slots, on features drawn once for
    the largest shape so far (a draw inside the timed call would be priced as catch-up)."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.serve.speculation.config import parse_speculative_config

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8})
    proposer = DFlashProposer(config, demo_target, 3, 256)
    written, storages = [], []
    monkeypatch.setattr(proposer, "_write_context", lambda slots, starts, counts, features: (
        written.append((slots, starts, counts, tuple(features.shape))),
        storages.append(features.untyped_storage().data_ptr())))
    timer = proposer.catch_up_timer()
    assert timer.most_positions == proposer.cache.max_len
    timer.run(2, 40)
    timer.run(1, 20)
    width = len(proposer.feature_layers) * demo_target.config.hidden_size
    assert written == [([0, 1], [0, 0], [40, 40], (2, 40, width)), ([0], [0], [20], (1, 20, width))]
    assert storages[0] == storages[1]  # the smaller shape reads the features drawn for the larger


def test_the_draft_timer_drafts_steady_blocks_and_frees_its_slots(demo_target, monkeypatch):
    """The draft timer runs what a steady step runs: a propose of k drafts a row for slots 0..rows-1, no catch-up,
    over `context` positions a row written once per slot (on the first run that needs the slot, untimed);
    `done` leaves the slots unowned, so a request's context is written from its position 0."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.serve.speculation.config import parse_speculative_config

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8})
    proposer = DFlashProposer(config, demo_target, 3, 256)
    observed, proposed = [], []
    observe, propose = proposer.observe, proposer.propose
    monkeypatch.setattr(proposer, "observe", lambda rows, starts, counts, features: (
        observed.append(([r.slot for r in rows], starts, counts)), observe(rows, starts, counts, features)))
    monkeypatch.setattr(proposer, "propose", lambda rows, drafts, *rest: proposed.append(
        ([r.slot for r in rows], list(drafts), propose(rows, drafts, *rest))))
    timer = proposer.draft_timer(64)
    timer.run(2)
    timer.run(2)
    timer.run(1)
    assert observed == [([0], [0], [64]), ([1], [0], [64])]
    assert [(slots, drafts) for slots, drafts, _ in proposed] == [([0, 1], [8, 8])] * 2 + [([0], [8])]
    assert all(batch.steady and batch.counts.tolist() == [8] * len(slots) for slots, _, batch in proposed)
    assert proposer.context_len[:2] == [64, 64]
    timer.done()
    assert proposer.owner == [None] * 3
    assert DFlashProposer(config, demo_target, 3, 32).draft_timer(64) is not None  # the context fits the cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafts_are_read_out_through_the_targets_lm_head_in_the_draft_dtype(demo_target, dtype):
    """The drafts' logits come from the target's LM head in the draft dtype: the target's own layer where
    their dtypes agree, else a copy of its weight in the draft dtype, with the same logits as the head's own
    readout up to that dtype's rounding."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.serve.speculation.config import parse_speculative_config

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8,
                                       "draft_dtype": dtype})
    proposer = DFlashProposer(config, demo_target, 1, 64)
    assert proposer.lm_head.weight.dtype == getattr(torch, dtype)
    assert (proposer.lm_head is demo_target.lm_head) == (dtype == "float32")
    assert torch.equal(proposer.lm_head.weight, demo_target.lm_head.weight.to(getattr(torch, dtype)))
    hidden = torch.randn(2, 3, demo_target.config.hidden_size).to(getattr(torch, dtype))
    with torch.inference_mode():
        logits = proposer.readout(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (2, 3, demo_target.config.vocab_size)
        torch.testing.assert_close(logits, proposer.head.readout(hidden), atol=0.05 if dtype == "bfloat16" else 1e-5,
                                   rtol=0.02 if dtype == "bfloat16" else 1e-5)


def test_k_beyond_the_block_is_one_line(demo_target, tmp_path):
    head_dir = _save(random_dflash_head(demo_target, block_size=5), tmp_path / "head")
    with pytest.raises(DraftsmithError, match=r"num_speculative_tokens=6, but the dflash head .* drafts at most 4"):
        _serve(head_dir, k=6)
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "mask_token_id": 9000}))
    with pytest.raises(DraftsmithError, match="mask_token_id 9000 is outside the target's vocabulary of 8192"):
        _serve(head_dir)


def test_an_anchor_first_head_drafts_its_whole_block_as_it_was_taught(demo_target, tmp_path, greedy_reference):
    """Anchor-first (`sample_from_anchor`): every block position's output is a draft, the anchor's the first,
    so a block of 5 drafts 5; the proposer's drafts are the teacher-forced block's read that way, and decoding
    stays lossless."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.serve.speculation.config import parse_speculative_config
    from helpers import Row

    head_dir = _save(random_dflash_head(demo_target, sample_from_anchor=True, seed=4), tmp_path / "head")
    config = parse_speculative_config({"method": "dflash", "model": str(head_dir), "num_speculative_tokens": 5,
                                       "draft_dtype": "float32"})
    proposer = DFlashProposer(config, demo_target, 1, 128)
    head, ids = proposer.head, torch.randint(4, 8000, (1, 20))
    with torch.no_grad():
        out = demo_target(ids, feature_layers=head.feature_layers)
        features = head.features(out.hidden_states)
        taught = head.training_forward(features, ids, torch.tensor([[19]]), 5)
    proposer.observe([Row("a", 0, ids[0, :19].tolist(), [])], [0], [19], features[:, :19])
    drafts = proposer.propose([Row("a", 0, ids[0, :19].tolist(), [int(ids[0, 19])])], [5]).tokens[0].tolist()
    assert drafts == head.readout(taught).argmax(-1)[0].tolist()
    with pytest.raises(DraftsmithError, match="drafts at most 5 tokens a step"):
        _serve(head_dir, k=6)
    llm = _serve(head_dir, k=5)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference


@pytest.mark.slow
def test_init_from_reads_the_layer_count_under_its_recipe_key(demo_target, tmp_path):
    """`model.num_draft_layers` is the saved head's `num_hidden_layers`: the same count continues it, another
    is one line."""
    from draftsmith.train.trainer import build_head

    random_dflash_head(demo_target, layers=2).save_pretrained(tmp_path / "saved")
    raw = tiny_recipe(DEMO_MODEL, write_code_corpus(tmp_path / "code.jsonl"), tmp_path / "run", "dflash")
    raw["model"].update(init_from=str(tmp_path / "saved"), num_draft_layers=2, block_size=5)
    assert build_head(validate_recipe(raw), demo_target, None).config.num_hidden_layers == 2
    raw["model"].update(num_draft_layers=3)
    with pytest.raises(DraftsmithError, match=r"num_draft_layers: 3 \(the head has 2\)"):
        build_head(validate_recipe(raw), demo_target, None)


def test_training_learns_the_targets_next_tokens(tmp_path):
    """On the demo target (a random tiny one predicts near-uniformly: nothing to agree on), a regular corpus."""
    data = write_code_corpus(tmp_path / "code.jsonl")
    raw = tiny_recipe(DEMO_MODEL, data, tmp_path / "run", "dflash", epochs=4, num_anchors=8, learning_rate=1e-3)
    raw["model"].update(block_size=4)
    final = train(validate_recipe(raw), ["test"])
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(log[-5:], "loss") < mean(log[:5], "loss")
    assert mean(log[-5:], "acc_pos1") > mean(log[:5], "acc_pos1") + 0.15, [r["acc_pos1"] for r in log]
    head = load_head(final)
    assert head.head_type == "dflash" and head.config.block_size == 4 and head.config.mask_token_id == 3
    report = json.loads((tmp_path / "run" / "eval_epoch4.json").read_text())
    assert report["sim_mean_acceptance_length_k1"] > 1.0 and report["sim_accept_pos2"] > 0, report
    assert report["sim_served_acceptance_length"] > 1.0, report


@pytest.mark.parametrize("anchor_first", [False, True])
def test_loss_positions_learn_the_first_drafts_alone(demo_target, anchor_first):
    """`loss_positions: n`: the last layer runs the block positions of drafts 1..n only (1..n in the 1+N
    layout, 0..n-1 anchor-first), as they are in the whole block's forward; the loss is the one every draft
    gives when the later ones weigh nothing, and that is the first draft's soft cross-entropy against the
    target's next token after the anchor."""
    from types import SimpleNamespace

    from draftsmith.methods.dflash.objective import dflash_objective, sample_anchors
    from draftsmith.train.objectives import target_features

    head = random_dflash_head(demo_target, block_size=5, sample_from_anchor=anchor_first)
    first = 0 if anchor_first else 1
    ids = torch.randint(4, 8000, (2, 24))
    features = target_features(demo_target, head.feature_layers, ids, "float32")
    with torch.no_grad():
        anchors = torch.tensor([[5, 13, 17], [2, 9, 19]])
        whole = head.training_forward(features["features"], ids, anchors).view(2, 3, 5, -1)
        firsts = head.training_forward(features["features"], ids, anchors, 2).view(2, 3, 2, -1)
        torch.testing.assert_close(firsts, whole[:, :, first : first + 2], atol=1e-5, rtol=1e-5)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([24, 24])}
    losses = []
    for positions in (None, 1):
        torch.manual_seed(0)  # the same anchors
        cfg = SimpleNamespace(num_anchors=4, loss_decay_gamma=0.01, loss_positions=positions)
        losses.append(dflash_objective(head, demo_target, batch, features, cfg)[0])
    torch.testing.assert_close(losses[0], losses[1], atol=1e-4, rtol=1e-4)
    torch.manual_seed(0)
    anchors, _ = sample_anchors(batch["loss_mask"], [24, 24], 4, "cpu")
    with torch.no_grad():
        drafts = head.readout(head.training_forward(features["features"], ids, anchors).view(2, 4, 5, -1)[:, :, first])
        wanted = demo_target.lm_head(features["last"].gather(1, anchors[:, :, None].expand(-1, -1, 256)))
    want = -(torch.softmax(wanted, -1) * torch.log_softmax(drafts, -1)).sum(-1).mean()
    torch.testing.assert_close(losses[0], want, atol=1e-4, rtol=1e-4)
    most = 5 if anchor_first else 4
    with pytest.raises(DraftsmithError, match=f"loss_positions {most + 1}: the head's block_size 5 drafts {most} "
                                              f"positions; set loss_positions <= {most}"):
        dflash_objective(head, demo_target, batch, features, SimpleNamespace(num_anchors=4, loss_decay_gamma=1.0,
                                                                              loss_positions=most + 1))


def test_anchors_draft_only_where_the_next_token_is_learned():
    """With a masked prompt (data.mask_prompt) every block starts where its first draft is a learned token, and
    a fully learned row draws from every position with context before it and a token after it."""
    from draftsmith.methods.dflash.objective import sample_anchors

    loss_mask = torch.zeros(2, 12, dtype=torch.long)
    loss_mask[0, 7:10] = 1  # prompt of 7 tokens, 3 learned, then padding
    loss_mask[1] = 1
    torch.manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, [10, 12], 5, "cpu")
    assert sorted(anchors[0][valid[0]].tolist()) == [6, 7, 8] and valid[0].sum() == 3
    assert set(anchors[1].tolist()) <= set(range(1, 11)) and valid[1].all() and len(set(anchors[1].tolist())) == 5


def test_the_served_walk_is_what_the_engine_drafts(demo_target):
    """The eval's served walk (`served_walk`) over the engine's own greedy output, from teacher-forced blocks at
    every position, accepts what the engine accepted step by step (k = 8, fp32 drafts)."""
    from draftsmith.methods.dflash.objective import block_chains
    from draftsmith.methods.served_walk import served_walk
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.train.objectives import target_features

    llm = _serve(SHIPPED, k=8)
    steps = []  # (drafted, accepted) of each row step
    observe = llm.engine.spec_metrics.observe
    llm.engine.spec_metrics.observe = lambda *step: steps.append(step) or observe(*step)
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[0], add_special_tokens=False).input_ids
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    ids = torch.tensor([prompt + list(out[0].outputs[0].token_ids)])
    head = llm.engine.proposer.head
    anchors = torch.arange(len(prompt), ids.shape[1] - 8)[None]
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "lengths": torch.tensor([ids.shape[1]])}
    with torch.no_grad():
        features = target_features(demo_target, head.feature_layers, ids, "float32")
        chains = block_chains(head, demo_target, batch, features, anchors, 8).sum(-1)[0]
    walk = served_walk(dict(zip(anchors[0].tolist(), chains.tolist())), len(prompt))
    full = [accepted for drafted, accepted in steps if drafted == 8][: len(walk)]
    assert len(full) >= 8 and walk[: len(full)] == full, (walk, steps)
    assert sum(full) > 0


# -- conversion -------------------------------------------------------------------------------------------------
def _zlab_checkpoint(head, directory, **dflash_extra):
    """A head written the way z-lab publishes DFlash drafts (a flat Qwen3 config, dflash_config, bare names)."""
    from safetensors.torch import save_file

    c = head.config
    directory.mkdir(parents=True)
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope.theta,
              "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
              "block_size": c.block_size, "num_target_layers": c.target_num_layers,
              "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": [0, 2, 4], **dflash_extra}}
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def test_a_zlab_checkpoint_converts_and_decodes_losslessly(demo_target, tmp_path, greedy_reference):
    import public_checkpoints as pub

    head = random_dflash_head(demo_target, seed=2)
    source = _zlab_checkpoint(head, tmp_path / "zlab")
    assert pub.convert(source, tmp_path / "native") == 0
    config, tensors = pub.read_native(tmp_path / "native")
    assert config["draftsmith_head_type"] == "dflash" and config["aux_layer_ids"] == [1, 3, 5]  # z-lab ids + 1
    assert (config["block_size"], config["mask_token_id"], config["target_num_layers"]) == (5, 3, 6)
    assert all(torch.equal(tensors[k], v) for k, v in head.state_dict().items())
    llm = _serve(tmp_path / "native")
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference


@pytest.mark.parametrize("anchor_first", [False, True])
@pytest.mark.parametrize("to", ["vllm", "speculators"])
def test_round_trips_are_lossless(demo_target, tmp_path, to, anchor_first, capsys):
    """Both block layouts survive both exports; an anchor-first export says vLLM cannot serve it (its dflash
    method refuses the key), and its speculators config drafts the whole block."""
    import public_checkpoints as pub

    head = random_dflash_head(demo_target, seed=3, sample_from_anchor=anchor_first)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(tmp_path / "native")
    config, tensors = pub.read_native(tmp_path / "native")
    assert pub.convert(tmp_path / "native", tmp_path / to, "--to", to) == 0
    exported = json.loads((tmp_path / to / "config.json").read_text())
    layout = {"sample_from_anchor": True, "query_zero_predicts_next": True} if anchor_first else {}
    if to == "vllm":  # z-lab's layout, which vLLM loads
        assert exported["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2, 4], **layout}
    else:
        assert exported["speculators_model_type"] == "dflash" and exported["aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert exported["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4 + anchor_first
        assert exported["sample_from_anchor"] is anchor_first
    assert ("vLLM cannot serve this export: the head drafts anchor-first" in capsys.readouterr().out) is anchor_first
    assert pub.convert(tmp_path / to, tmp_path / "back") == 0
    config_back, tensors_back = pub.read_native(tmp_path / "back")
    assert config_back == config and tensors_back.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors_back[k]) for k in tensors)


@pytest.mark.parametrize("to", ["vllm", "speculators"])
def test_a_window_survives_both_exports_in_each_readers_keys(demo_target, tmp_path, to):
    """A windowed head's export keeps its block non-causal in the reader's own keys: vLLM's
    dflash_config.use_swa (its layer_types windows are causal within the block), speculators' layer_types with
    sliding_window_non_causal; both read back as the same head."""
    import public_checkpoints as pub

    head = random_dflash_head(demo_target, seed=3, window=64)
    head.config.target_model = str(DEMO_MODEL)
    head.save_pretrained(tmp_path / "native")
    config = pub.read_native(tmp_path / "native")[0]
    assert pub.convert(tmp_path / "native", tmp_path / to, "--to", to) == 0
    exported = json.loads((tmp_path / to / "config.json").read_text())
    if to == "vllm":
        assert exported["dflash_config"]["use_swa"] is True and exported["dflash_config"]["swa_window_size"] == 64
        assert exported["dflash_config"]["causal"] is False and exported["use_sliding_window"] is False
        assert "layer_types" not in exported
    else:
        layer = exported["transformer_layer_config"]
        assert layer["layer_types"] == ["sliding_attention"] * 2 and layer["sliding_window"] == 64
        assert exported["sliding_window_non_causal"] is True
    assert pub.convert(tmp_path / to, tmp_path / "back") == 0
    assert pub.read_native(tmp_path / "back")[0] == config and config["sliding_window"] == 64


def test_a_window_read_as_causal_is_refused(demo_target, tmp_path, capsys):
    """Sliding layers that their readers run causal within the block (z-lab's layer_types, speculators' without
    sliding_window_non_causal) are a one-line error: draftsmith's block sees all of itself."""
    import public_checkpoints as pub

    head = random_dflash_head(demo_target, seed=3)
    source = _zlab_checkpoint(head, tmp_path / "zlab")
    config = json.loads((source / "config.json").read_text())
    config.update(layer_types=["sliding_attention"] * 2, sliding_window=64)
    (source / "config.json").write_text(json.dumps(config))
    assert pub.convert(source, tmp_path / "a") == 2
    assert "sliding layers, which vLLM runs causal within the block" in capsys.readouterr().err
    config["dflash_config"]["causal"] = False
    (source / "config.json").write_text(json.dumps(config))
    assert pub.convert(source, tmp_path / "b") == 0
    assert pub.read_native(tmp_path / "b")[0]["sliding_window"] == 64
    assert pub.convert(tmp_path / "b", tmp_path / "spec", "--to", "speculators") == 0
    exported = json.loads((tmp_path / "spec" / "config.json").read_text())
    del exported["sliding_window_non_causal"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(exported))
    capsys.readouterr()
    assert pub.convert(tmp_path / "spec", tmp_path / "c") == 2
    assert "without sliding_window_non_causal attend causally" in capsys.readouterr().err


def test_sglangs_layout_key_reads_as_anchor_first(demo_target, tmp_path, capsys):
    import public_checkpoints as pub

    head = random_dflash_head(demo_target, seed=5, sample_from_anchor=True)
    assert pub.convert(_zlab_checkpoint(head, tmp_path / "zlab", query_zero_predicts_next=True), tmp_path / "a") == 0
    assert pub.read_native(tmp_path / "a")[0]["sample_from_anchor"] is True
    source = _zlab_checkpoint(head, tmp_path / "odd", sample_from_anchor="yes")
    assert pub.convert(source, tmp_path / "b") == 2
    assert "sample_from_anchor 'yes' must be true or false" in capsys.readouterr().err


def test_a_checkpoint_without_a_mask_token_is_one_line(demo_target, tmp_path, capsys):
    import public_checkpoints as pub

    source = _zlab_checkpoint(random_dflash_head(demo_target), tmp_path / "zlab")
    config = json.loads((source / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    (source / "config.json").write_text(json.dumps(config))
    assert pub.convert(source, tmp_path / "native") == 2
    assert "no mask_token_id: a DFlash head fills its block with that token" in capsys.readouterr().err


def test_a_checkpoint_with_odd_layer_ids_is_one_line(demo_target, tmp_path, capsys):
    import public_checkpoints as pub

    source = _zlab_checkpoint(random_dflash_head(demo_target), tmp_path / "zlab")
    config = json.loads((source / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = ["0", 2, 4]
    (source / "config.json").write_text(json.dumps(config))
    assert pub.convert(source, tmp_path / "native") == 2
    assert "target_layer_ids must be a non-empty list of layer ids" in capsys.readouterr().err


def test_plain_steps_projected_later_draft_as_if_projected_at_once(monkeypatch):
    """Plain steps' hidden states, and the prompts prefilled while the policy held, are kept and projected
    when drafting resumes: the shipped head then drafts exactly what it drafts when every prompt and plain
    step projects its own (k = 0 while 2-3 requests run, 8 once one is left; requests of unequal length)."""
    from draftsmith.methods.dflash.proposer import DFlashProposer

    def run():
        llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
                  speculative_config={"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8,
                                      "num_speculative_tokens_per_batch_size": [[2, 3, 0], [1, 1, 8]]})
        params = [SamplingParams(temperature=0, max_tokens=n) for n in (12, 20, 48)]
        out = llm.generate(CODE_PROMPTS[:3], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in out], llm.get_metrics()

    lazy_tokens, lazy = run()
    monkeypatch.setattr(DFlashProposer, "observe_later", lambda self, rows, starts, hidden: False)
    monkeypatch.setattr(DFlashProposer, "observe_prompt_later", lambda self, *args: False)
    eager_tokens, eager = run()
    assert lazy_tokens == eager_tokens
    assert lazy["num_steps_without_speculation"] > 10 and lazy["num_draft_tokens"] > 0
    assert (lazy["num_draft_tokens"], lazy["num_accepted_tokens"]) == (eager["num_draft_tokens"], eager["num_accepted_tokens"])


def test_served_blocks_are_the_teacher_forced_blocks_step_after_step(demo_target):
    """The proposer's drafts (context projected as the engine hands it over: the prompt, then each step's
    verified positions) equal the teacher-forced block from the same position over the whole text, over steps
    that accept part of the drafts: the block's own keys and values never leak into a later step."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.serve.speculation.config import parse_speculative_config
    from helpers import Row

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8,
                                       "draft_dtype": "float32"})
    proposer = DFlashProposer(config, demo_target, 2, 256)
    head = proposer.head
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[1], add_special_tokens=False).input_ids

    def features(ids):
        with torch.no_grad():
            out = demo_target(torch.tensor([ids]), feature_layers=head.feature_layers)
        return out, head.features(out.hidden_states)

    out, feats = features(prompt)
    row = Row("a", 1, prompt, [int(out.logits[0, -1].argmax())])
    proposer.observe([row], [0], [len(prompt)], feats)
    accepted = 0
    for step in range(4):
        drafts = proposer.propose([row], [8]).tokens[0].tolist()
        ids = row.all_token_ids()
        _, feats = features(ids)
        with torch.no_grad():
            taught = head.training_forward(feats, torch.tensor([ids]), torch.tensor([[len(ids) - 1]]))
            assert drafts == head.readout(taught[:, 1:]).argmax(-1)[0].tolist()
        keep = step % 3  # 0, 1 or 2 drafts accepted, then a token that is not the next draft
        accepted += keep
        start = len(ids) - 1
        row.output_token_ids += drafts[:keep] + [(drafts[keep] + 1) % 8000 + 4]
        _, feats = features(row.all_token_ids())
        proposer.observe([row], [start], [keep + 1], feats[:, start : start + keep + 1])
    assert accepted == 3


@pytest.mark.parametrize("attention", ["cpp", "torch"])
def test_a_windowed_block_drafts_what_training_teaches_from_the_prompts_newest_positions(demo_target, attention,
                                                                                        monkeypatch):
    """With `sliding_window` W each block position attends over the newest W positions up to its own and the
    rest of its block, in training and serving alike (through the C++ slot kernel and PyTorch's attention): a
    proposer fed only the prompt's newest W positions (what the engine hands over, `observe_window`) drafts,
    step after step, the windowed teacher-forced block over the whole text; and the window changes what the
    block computes there."""
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", attention)
    from draftsmith.models.tokenizer import load_tokenizer
    from helpers import Row

    window = 16
    head = random_dflash_head(demo_target, seed=4, window=window)
    whole = random_dflash_head(demo_target, seed=4)
    config = parse_speculative_config({"method": "dflash", "model": "unused", "num_speculative_tokens": 4,
                                       "draft_dtype": "float32"})
    proposer = _proposer_of(head, config, demo_target)
    assert proposer.observe_window == window
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[3] * 3, add_special_tokens=False).input_ids
    assert len(prompt) > 2 * window

    def features(ids):
        with torch.no_grad():
            return head.features(demo_target(torch.tensor([ids]), feature_layers=head.feature_layers).hidden_states)

    row = Row("a", 0, prompt, [7])
    feats = features(prompt)
    proposer.observe([row], [len(prompt) - window], [window], feats[:, -window:])
    differs = False
    for _ in range(3):
        drafts = proposer.propose([row], [4]).tokens[0].tolist()
        ids = row.all_token_ids()
        feats = features(ids)
        anchor = torch.tensor([[len(ids) - 1]])
        with torch.no_grad():
            taught = head.readout(head.training_forward(feats, torch.tensor([ids]), anchor)[:, 1:])
            unwindowed = whole.readout(whole.training_forward(feats, torch.tensor([ids]), anchor)[:, 1:])
        assert drafts == taught.argmax(-1)[0].tolist()
        differs = differs or not torch.allclose(taught, unwindowed, atol=1e-3)
        start = len(ids) - 1
        row.output_token_ids += drafts[:1] + [(drafts[1] + 1) % 8000 + 4]
        feats = features(row.all_token_ids())
        proposer.observe([row], [start], [2], feats[:, start : start + 2])
    assert differs, "the window changed nothing: the test does not reach past it"


def _proposer_of(head, config, target):
    """A DFlash proposer drafting with `head` as it is (not loaded from a directory)."""
    import draftsmith.methods.dflash.proposer as dflash

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dflash, "load_attached_head", lambda *args: head)
        return dflash.DFlashProposer(config, target, 2, 256)


def test_a_window_leaves_no_gap_it_would_read(demo_target):
    """A windowed proposer takes a prompt chunk that starts past the positions observed before it only where the
    chunk holds a whole window (the skipped positions are older than any window reads); a window no wider than
    the block is a one-line error."""
    from helpers import Row

    config = parse_speculative_config({"method": "dflash", "model": "unused", "num_speculative_tokens": 4})
    proposer = _proposer_of(random_dflash_head(demo_target, window=8), config, demo_target)
    row = Row("a", 0, list(range(4, 40)), [])
    features = torch.zeros(1, 36, 3 * demo_target.config.hidden_size)
    with pytest.raises(DraftsmithError, match="must continue each request's earlier ones"):
        proposer.observe([row], [30], [6], features[:, :6])
    proposer.observe([row], [28], [8], features[:, :8])
    assert proposer.context_len[0] == 36
    with pytest.raises(DraftsmithError, match="sliding_window 5: more than block_size 5"):
        random_dflash_head(demo_target, window=5)


def test_a_windowed_head_keeps_greedy_equality_fed_only_its_window(demo_target, tmp_path, greedy_reference):
    """An engine hands a windowed head only the newest `sliding_window` positions of each prompt, and decodes
    what plain decoding does."""
    window = 8
    llm = _serve(_save(random_dflash_head(demo_target, seed=6, window=window), tmp_path / "head"))
    observed, observe = [], llm.engine.proposer.observe
    llm.engine.proposer.observe = lambda rows, starts, counts, features: (
        observed.append(list(counts)) or observe(rows, starts, counts, features))
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.get_metrics()["num_draft_tokens"] > 0
    assert max(max(counts) for counts in observed) <= window


def test_kept_plain_steps_are_the_catch_up_the_policy_prices(demo_target):
    """The plain steps kept for later are what a resuming row owes before it drafts: `catch_up` says how many
    rows and positions, and the draft that projects them reports itself not steady (the ledger then teaches
    the cost model a catch-up, not a draft forward); with nothing kept, neither. A finished request's kept
    steps are owed by no one: not by the next request in its slot."""
    from draftsmith.methods.dflash.proposer import DFlashProposer
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.serve.speculation.config import parse_speculative_config
    from helpers import Row

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8})
    proposer = DFlashProposer(config, demo_target, 2, 256)
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[1], add_special_tokens=False).input_ids
    with torch.no_grad():
        out = demo_target(torch.tensor([prompt]), feature_layers=proposer.feature_layers)
    cut = len(prompt) - 6
    row, idle = Row("a", 1, prompt[:cut], [prompt[cut]]), Row("b", 0, prompt[:5], [])

    def keep_plain_steps(row, count):
        for position in range(len(row.all_token_ids()) - 1, len(row.all_token_ids()) - 1 + count):
            row.output_token_ids.append(prompt[position + 1])
            hidden = {layer: h[:, position : position + 1] for layer, h in out.hidden_states.items()}
            assert proposer.observe_later([row], [position], hidden)

    proposer.observe([row], [0], [cut], proposer.features(out.hidden_states)[:, :cut])
    assert proposer.catch_up([row]) == (0, 0)
    assert proposer.propose([row], [8]).steady
    keep_plain_steps(row, 3)
    assert proposer.catch_up([row, idle]) == (1, 3)
    assert not proposer.propose([row], [8]).steady
    assert proposer.catch_up([row]) == (0, 0)
    keep_plain_steps(row, 2)
    proposer.release(row)  # it finished; the next request takes its slot
    successor = Row("c", 1, prompt[:cut], [prompt[cut]])
    proposer.observe([successor], [0], [cut], proposer.features(out.hidden_states)[:, :cut])
    assert proposer.catch_up([successor]) == (0, 0)
    assert proposer.propose([successor], [8]).steady


def test_past_the_kept_budget_finished_requests_go_first_unprojected(demo_target, monkeypatch):
    """Kept plain steps within MAX_LATER_BYTES stay unprojected; past it, those of finished requests are dropped
    (nothing projected), and only when the live ones alone fill it are they projected, which leaves the row
    owing only what came after."""
    import draftsmith.methods.dflash.proposer as dflash
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.serve.speculation.config import parse_speculative_config
    from helpers import Row

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8})
    proposer = dflash.DFlashProposer(config, demo_target, 2, 256)
    written = []
    original = proposer._write_context
    monkeypatch.setattr(proposer, "_write_context", lambda *a: written.append(sum(a[2])) or original(*a))
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[1], add_special_tokens=False).input_ids
    with torch.no_grad():
        out = demo_target(torch.tensor([prompt]), feature_layers=proposer.feature_layers)
    cut = 5  # and up to 9 plain steps after it, within the prompt
    finished, live = Row("a", 0, prompt[:cut], [prompt[cut]]), Row("b", 1, prompt[:cut], [prompt[cut]])
    for row in (finished, live):
        proposer.observe([row], [0], [cut], proposer.features(out.hidden_states)[:, :cut])
    written.clear()

    def keep_steps(row, count):
        for _ in range(count):
            position = len(row.all_token_ids()) - 1
            row.output_token_ids.append(prompt[position + 1])
            assert proposer.observe_later([row], [position], {layer: h[:, position : position + 1]
                                                              for layer, h in out.hidden_states.items()})

    step_bytes = sum(h[:, :1].numel() * h.element_size() for h in out.hidden_states.values())
    monkeypatch.setattr(dflash, "MAX_LATER_BYTES", 4 * step_bytes)
    keep_steps(finished, 3)
    proposer.release(finished)
    keep_steps(live, 2)  # the fifth step: the finished request's three are dropped
    assert not written and proposer.catch_up([live]) == (1, 2)
    keep_steps(live, 2)
    assert not written and proposer.catch_up([live]) == (1, 4)
    keep_steps(live, 1)  # live steps alone fill the budget: they are projected
    assert written == [4] and proposer.catch_up([live]) == (1, 1)


def test_a_request_that_never_drafts_never_projects_its_context(monkeypatch):
    """Kept positions are projected only when drafting needs them: while the policy holds every step (k = 0 at
    every batch size), no context is written, neither the prompts' nor the plain steps', though new requests
    join beside rows with kept steps (3 requests, 2 slots). Projected at each plain step, the demo model at 8
    in flight lost 7% to a head the policy kept off; its prompts, projected at prefill, 4% more."""
    from draftsmith.methods.dflash.proposer import DFlashProposer

    written = []
    original = DFlashProposer._write_context

    def counting(self, slots, starts, counts, features):
        written.append(sum(counts))
        return original(self, slots, starts, counts, features)

    monkeypatch.setattr(DFlashProposer, "_write_context", counting)
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=2, max_model_len=256,
              speculative_config={"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8,
                                  "num_speculative_tokens_per_batch_size": [[1, 2, 0]]})
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (8, 24, 16)]
    out = llm.generate(CODE_PROMPTS[:3], params, use_tqdm=False)
    assert llm.get_metrics()["num_steps_without_speculation"] > 20
    assert len(out) == 3 and sum(written) == 0


def test_a_prompt_kept_while_held_is_the_catch_up_and_drafts_as_if_fed_at_once(demo_target, monkeypatch):
    """A prompt kept unprojected (`observe_prompt_later`) is what the row owes before it drafts, a first feed
    (`unfed_rows`: the policy spreads it over the request's steps), and its first drafts are those of a prompt
    projected at prefill; past the byte budget a prompt is taken at once."""
    import draftsmith.methods.dflash.proposer as dflash
    from draftsmith.models.tokenizer import load_tokenizer
    from draftsmith.serve.speculation.config import parse_speculative_config
    from helpers import Row

    config = parse_speculative_config({"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8})
    prompt = load_tokenizer(DEMO_MODEL)(CODE_PROMPTS[1], add_special_tokens=False).input_ids
    eager, lazy = (dflash.DFlashProposer(config, demo_target, 2, 256) for _ in range(2))
    with torch.no_grad():
        out = demo_target(torch.tensor([prompt]), feature_layers=eager.feature_layers)
    features = eager.features(out.hidden_states)
    row = Row("a", 1, prompt, [int(out.logits[0, -1].argmax())])
    eager.observe([row], [0], [len(prompt)], features)
    cut = len(prompt) // 2  # a prompt in two chunks
    hidden = out.hidden_states
    assert lazy.observe_prompt_later([row], [0], [cut], {i: h[:, :cut] for i, h in hidden.items()})
    assert lazy.observe_prompt_later([row], [cut], [len(prompt) - cut], {i: h[:, cut:] for i, h in hidden.items()})
    assert lazy.catch_up([row]) == (1, len(prompt)) and lazy.unfed_rows([row]) == [0]
    assert eager.unfed_rows([row]) == []
    drafted = lazy.propose([row], [8])
    assert not drafted.steady and lazy.catch_up([row]) == (0, 0) and lazy.unfed_rows([row]) == []
    assert torch.equal(drafted.tokens[0], eager.propose([row], [8]).tokens[0])
    monkeypatch.setattr(dflash, "MAX_LATER_BYTES", sum(h.numel() * h.element_size() for h in hidden.values()) - 1)
    other = Row("b", 0, prompt, [1])
    assert not lazy.observe_prompt_later([other], [0], [len(prompt)], hidden)
    assert lazy.catch_up([other]) == (0, 0)


def test_a_prompt_prefilled_while_held_is_kept_unread(monkeypatch):
    """While the policy holds (more rows than disable_by_batch_size), a packed prefill's hidden states are kept
    as the forward left them: no layer is unpacked and no feature made until the head drafts."""
    unpacked = []
    unpack = ForwardBatch.unpack
    monkeypatch.setattr(ForwardBatch, "unpack", lambda self, packed: unpacked.append(1) or unpack(self, packed))
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=3, max_model_len=256,
              speculative_config={"method": "dflash", "model": str(SHIPPED), "num_speculative_tokens": 8,
                                  "disable_by_batch_size": 2})
    engine = llm.engine
    monkeypatch.setattr(engine.proposer, "features", lambda hidden: pytest.fail("features made while held"))
    tokenizer = llm.tokenizer
    rows = [engine.add_request(tokenizer(p, add_special_tokens=False).input_ids,
                               SamplingParams(temperature=0, max_tokens=4)) for p in CODE_PROMPTS[:3]]
    engine.step()  # the three prompts, one packed prefill
    assert all(not r.prefilling for r in rows) and not unpacked
    assert engine.proposer.catch_up(rows) == (3, max(r.prompt_len for r in rows))


def test_a_head_config_missing_a_key_is_one_line():
    config = json.loads((SHIPPED / "config.json").read_text())
    del config["aux_layer_ids"]
    with pytest.raises(DraftsmithError, match="missing 1 required positional argument: 'aux_layer_ids'"):
        DFlashConfig.from_json(config)


def _recorded_drafts(llm) -> list:
    """Every step's drafts from now on, as the engine's proposer makes them."""
    seen, propose = [], llm.engine.proposer.propose

    def recorded(*args, **kwargs):
        batch = propose(*args, **kwargs)
        seen.append(batch.tokens.tolist())
        return batch

    llm.engine.proposer.propose = recorded
    return seen


@pytest.mark.slow
@pytest.mark.cuda
def test_blocks_run_through_the_triton_kernel(monkeypatch, demo_target, tmp_path, kernel_target,
                                              kernel_greedy_reference):
    """A DFlash block (every block query sees the whole block) attends through the Triton slot kernel as a
    causal mask at the block's end (eager steps, on KERNEL_DEVICE); greedy decoding stays the plain engine's."""
    from helpers import KERNEL_DEVICE, slot_kernel_or_skip

    kernel = slot_kernel_or_skip()
    engine = {"device": KERNEL_DEVICE, "target": kernel_target, "enforce_eager": True}
    calls = []
    real = kernel.slot_attention
    monkeypatch.setattr(kernel, "slot_attention", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "triton")
    head_dir = _save(random_dflash_head(demo_target), tmp_path / "head")

    llm = _serve(head_dir, engine=engine)
    kernel_drafts = _recorded_drafts(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == kernel_greedy_reference
    assert llm.engine.proposer.cache.k[0].shape in calls and llm.get_metrics()["num_draft_tokens"] > 0
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")  # the same drafts as PyTorch's masked attention makes
    torch_llm = _serve(head_dir, engine=engine)
    torch_drafts = _recorded_drafts(torch_llm)
    torch_llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert kernel_drafts == torch_drafts and len(kernel_drafts) > 10


@pytest.mark.slow
def test_blocks_run_through_the_cpu_kernel_outside_the_interpreter(monkeypatch, demo_target, tmp_path,
                                                                   greedy_reference):
    """On CPU by default (`auto`), without Triton's interpreter, a DFlash block attends through the C++ slot
    kernel (the Triton one would refuse CPU tensors there): greedy decoding stays plain decoding's, and the
    drafts are those PyTorch's masked attention makes."""
    from draftsmith.models import attention
    from draftsmith.models.slot_attention_cpu import build_error

    if build_error() is not None:
        pytest.skip(f"the CPU attention kernel did not build: {build_error()}")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("DRAFTSMITH_ATTENTION", raising=False)
    calls = []
    real = attention.slot_attention_cpu
    monkeypatch.setattr(attention, "slot_attention_cpu", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    head_dir = _save(random_dflash_head(demo_target), tmp_path / "head")
    engine = {"target": demo_target, "enforce_eager": True}

    llm = _serve(head_dir, engine=engine)
    kernel_drafts = _recorded_drafts(llm)
    got = llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == greedy_reference
    assert llm.engine.proposer.cache.k[0].shape in calls and llm.get_metrics()["num_draft_tokens"] > 0
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    torch_llm = _serve(head_dir, engine=engine)
    torch_drafts = _recorded_drafts(torch_llm)
    torch_llm.generate(CODE_PROMPTS, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert kernel_drafts == torch_drafts and len(kernel_drafts) > 10
