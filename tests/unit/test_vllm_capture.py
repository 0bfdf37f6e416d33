"""Reading vLLM's hidden-state files back (`train.vllm_capture`), without vLLM: a file as its connector writes
it (`hidden_states` [tokens, layers, hidden] in vLLM's sorted layer order, the last layer unnormed) becomes
what draftsmith's own capture stores, for any feature layers; a file whose writer never finishes is an error
in the end, not a hang."""

import fcntl

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draftsmith.errors import DraftsmithError
from draftsmith.train.vllm_capture import VllmFeatures, read_written

HIDDEN, LAST = 8, 4


def _reader(layers: list[int]) -> VllmFeatures:
    """A VllmFeatures without a worker: what `_sample` reads."""
    reader = object.__new__(VllmFeatures)
    reader.hidden_size, reader.num_hidden_layers, reader.eps = HIDDEN, LAST, 1e-5
    reader.norm_weight = torch.linspace(0.5, 1.5, HIDDEN)
    reader.layers = layers
    return reader


def _written(tmp_path, ids: list[int], layers: list[int]):
    stacked = torch.randn(len(ids), len(layers), HIDDEN) * 10
    path = tmp_path / "0-abc.safetensors"
    save_file({"hidden_states": stacked, "token_ids": torch.tensor(ids)}, str(path))
    (tmp_path / "0-abc.safetensors.lock").touch()
    return path, {layer: stacked[:, j] for j, layer in enumerate(layers)}


@pytest.mark.parametrize("feature_layers", [(3, 1, 1), (LAST,), (0, LAST, 2)])
def test_a_written_file_becomes_the_captures_features_and_normed_last(tmp_path, feature_layers):
    ids = [5, 6, 7]
    layers = sorted(set(feature_layers) | {LAST})
    path, by_layer = _written(tmp_path, ids, layers)
    reader = _reader(layers)
    got = reader._sample(ids, path, feature_layers, torch.float32)
    normed = F.rms_norm(by_layer[LAST], (HIDDEN,), reader.norm_weight, 1e-5)
    expected = torch.cat([normed if i == LAST else by_layer[i] for i in feature_layers], dim=-1)
    torch.testing.assert_close(got["features"], expected)
    torch.testing.assert_close(got["last"], normed)
    assert normed.abs().mean() < 2 < by_layer[LAST].abs().mean()  # the norm was applied
    assert not path.exists() and not path.with_name(path.name + ".lock").exists()  # read once, removed


def test_a_file_for_other_tokens_is_refused(tmp_path):
    path, _ = _written(tmp_path, [5, 6, 7], [1, LAST])
    with pytest.raises(DraftsmithError, match="for other tokens"):
        _reader([1, LAST])._sample([5, 6, 8], path, (1,), torch.float32)


def test_a_file_still_locked_by_its_writer_is_waited_for_then_refused(tmp_path):
    path, _ = _written(tmp_path, [1, 2], [LAST])
    with open(path.with_name(path.name + ".lock")) as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        with pytest.raises(DraftsmithError, match="did not finish writing"):
            read_written(path, timeout_s=0.05)
    assert read_written(path)["token_ids"].tolist() == [1, 2]  # released: read
