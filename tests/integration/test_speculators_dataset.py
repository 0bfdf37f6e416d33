"""draftsmith's trainer reads speculators' own offline data (train.speculators_dataset): a folder laid out as
`speculators generate-offline-data` writes it, its hidden states from HF transformers (an implementation
apart from draftsmith's), in bf16 and in hs_connectors' FP8; speculators' own reader is the oracle where it
is installed."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.corpus import load_records
from draftsmith.errors import DraftsmithError
from draftsmith.models import load_target
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.train.data import tokenize_dataset
from draftsmith.train.objectives import target_features
from draftsmith.train.recipe import validate_recipe
from draftsmith.train.speculators_dataset import SpeculatorsDataset, is_speculators_dataset
from draftsmith.train.trainer import prepare_datasets, train
from helpers import DEMO_MODEL, tiny_recipe, write_code_corpus
from speculators_oracle import INSTALL

LAYERS = (5, 1, 3)  # of the demo model's 6: the head's feature layers, in the recipe's order (vLLM stores them sorted)
STORED = (1, 3, 5, 6)  # what vLLM stacks: those and the last, ascending


def vllm_style_hidden_states(model, ids: list[int]) -> torch.Tensor:
    """[tokens, 4, hidden]: HF's hidden_states at STORED, the last (6) the decoder layers' output before the
    final norm, as vLLM's extract_hidden_states hands them to speculators."""
    unnormed = []
    hook = model.model.norm.register_forward_pre_hook(lambda _, args: unnormed.append(args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([*(out.hidden_states[i][0] for i in STORED[:-1]), unnormed[0][0]], dim=1)


def fp8_quantizer():
    try:
        from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
    except ImportError as exc:
        pytest.skip(f"hs_connectors does not import here ({exc}); install it test-only with: {INSTALL}")
    return SCALES_KEY, quantize_tensor_to_fp8


def write_speculators_folder(directory, records, fp8: bool) -> None:
    """`records` (input_ids, loss_mask) as a speculators offline dataset in `directory`."""
    import transformers
    from datasets import Dataset

    rows = Dataset.from_dict({"input_ids": [r["input_ids"] for r in records],
                              "loss_mask": [r["loss_mask"] for r in records]})
    try:  # speculators' own builder, which passes tokenized rows through as `prepare-data` writes them
        from speculators.data_generation.preprocessing import build_speculator_training_dataset
    except ImportError:  # its layout by hand: the rows, their lengths, torch format
        rows = rows.add_column("seq_len", [len(r["input_ids"]) for r in records]).with_format("torch")
    else:
        rows = build_speculator_training_dataset(rows, load_tokenizer(DEMO_MODEL), max_length=64, num_proc=1)
    rows.save_to_disk(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    (directory / "hidden_states").mkdir()
    for i, record in enumerate(records):
        stacked = vllm_style_hidden_states(model, record["input_ids"])
        tensors = {"hidden_states": stacked.to(torch.bfloat16), "token_ids": torch.tensor(record["input_ids"])}
        if fp8:
            scales_key, quantize = fp8_quantizer()
            tensors["hidden_states"], tensors[scales_key] = quantize(stacked.to(torch.bfloat16))
        save_file(tensors, str(directory / "hidden_states" / f"hs_{i}.safetensors"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculators-data")
    data = write_code_corpus(root / "code.jsonl", num_records=12)
    records = tokenize_dataset(load_records([str(data)]), load_tokenizer(DEMO_MODEL), 64)
    return root, data, [dict(r) for r in records]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_speculators_hidden_states_read_as_draftsmith_computes_them(corpus, tmp_path, fp8):
    _, _, records = corpus
    write_speculators_folder(tmp_path / "data", records[:4], fp8)
    assert is_speculators_dataset(tmp_path / "data")
    dataset = SpeculatorsDataset(tmp_path / "data", LAYERS, DEMO_MODEL, torch.float32)
    target = load_target(DEMO_MODEL, dtype="float32")
    # bf16 files: within bf16's rounding; FP8 with one scale per token: within E4M3's step of that token's
    # largest value (the quiet layers lose their small values, as speculators' connector stores them)
    tolerance = {"rtol": 2**-7, "atol": 1e-5} if not fp8 else {"rtol": 2**-4, "atol": None}
    for i, record in enumerate(records[:4]):
        item = dataset[i]
        assert item["input_ids"] == record["input_ids"] and item["loss_mask"] == record["loss_mask"]
        expected = target_features(target, LAYERS, torch.tensor([record["input_ids"]]), "float32")
        for key in ("features", "last"):
            got, want = item[key], expected[key][0]
            atol = tolerance["atol"] or want.abs().amax().item() * 2**-4
            torch.testing.assert_close(got, want, rtol=tolerance["rtol"], atol=atol)


def test_speculators_own_reader_agrees(corpus, tmp_path):
    """speculators' ArrowDataset, with hs_connectors' FP8 transfer, reads the same folder as this reader."""
    try:
        from hs_connectors.transfer import FP8Transfer
        from speculators.train.data import ArrowDataset
    except ImportError as exc:
        pytest.skip(f"speculators does not import here ({exc}); install it test-only with: {INSTALL}")
    _, _, records = corpus
    write_speculators_folder(tmp_path / "data", records[:3], fp8=True)
    theirs = ArrowDataset(max_len=64, datapath=str(tmp_path / "data"), on_missing="raise",
                          transfer=FP8Transfer(tmp_path / "data" / "hidden_states", torch.float32))
    ours = SpeculatorsDataset(tmp_path / "data", LAYERS, DEMO_MODEL, torch.float32)
    norm = load_target(DEMO_MODEL, dtype="float32").model.norm
    for i in range(3):
        theirs_item, ours_item = theirs[i], ours[i]
        assert theirs_item["input_ids"].tolist() == ours_item["input_ids"]
        assert theirs_item["loss_mask"].tolist() == ours_item["loss_mask"]
        # theirs: the feature layers as stored (ascending); ours: in the recipe's order
        stored = theirs_item["hidden_states"].unflatten(-1, (len(LAYERS), -1))
        in_recipe_order = stored[:, [STORED.index(layer) for layer in LAYERS]].flatten(1)
        torch.testing.assert_close(in_recipe_order, ours_item["features"], rtol=1e-6, atol=0)
        with torch.no_grad():
            normed = norm(theirs_item["verifier_last_hidden_states"])
        torch.testing.assert_close(normed, ours_item["last"], rtol=1e-5, atol=1e-5)


def test_a_folder_of_other_layers_or_missing_files_says_so(corpus, tmp_path):
    _, _, records = corpus
    write_speculators_folder(tmp_path / "data", records[:2], fp8=False)
    with pytest.raises(DraftsmithError, match=r"shape \[\d+, 4, 256\].*\[tokens, 3, 256\]: layers \[1, 3, 6\]"):
        SpeculatorsDataset(tmp_path / "data", (1, 3), DEMO_MODEL)
    cut = SpeculatorsDataset(tmp_path / "data", LAYERS, DEMO_MODEL, max_length=5)[0]  # as data.max_length cuts
    assert len(cut["input_ids"]) == len(cut["loss_mask"]) == len(cut["features"]) == len(cut["last"]) == 5
    (tmp_path / "data" / "hidden_states" / "hs_1.safetensors").unlink()
    with pytest.raises(DraftsmithError, match="lacks the hidden states of 1 of its 2 samples"):
        SpeculatorsDataset(tmp_path / "data", LAYERS, DEMO_MODEL)


@pytest.mark.slow
def test_the_trainer_trains_on_a_speculators_folder(corpus, tmp_path):
    _, data, records = corpus
    write_speculators_folder(tmp_path / "data", records, fp8=True)
    raw = tiny_recipe(DEMO_MODEL, data, tmp_path / "run", epochs=1, batch_size=2)
    raw["model"].update(aux_layer_ids=list(LAYERS))
    raw["data"].update(hidden_states_dir=str(tmp_path / "data"), eval_fraction=0.25)
    recipe = validate_recipe(raw)
    train_ds, eval_ds = prepare_datasets(recipe, load_tokenizer(DEMO_MODEL), LAYERS)
    assert len(train_ds) + len(eval_ds) == len(records) and train_ds[0]["features"].dtype == torch.bfloat16
    train(recipe, ["test"])
    report = json.loads((tmp_path / "run" / "eval_epoch1.json").read_text())
    assert report["sim_mean_acceptance_length_k1"] >= 1.0
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
