"""`draftsmith bench --shape NAME --random-weights`: the anchors' shapes are built right (parameter counts of
the real models), and the tiny shape runs the whole bench on CPU: plain decoding and a random EAGLE-3 head
whose drafts are accepted at the synthetic rates, with the acceptance those rates imply."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.models.config import TargetConfig
from draftsmith.models.llama import CausalLM
from draftsmith.serve.bench.shape import SHAPES


@pytest.mark.parametrize("shape,billions", [("llama-3.1-8b", 8.03), ("qwen3-8b", 8.19)])
def test_named_shapes_have_the_real_models_size(shape, billions):
    with torch.device("meta"):
        model = CausalLM(TargetConfig.from_hf_dict(SHAPES[shape]))
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_the_tiny_shape_runs_plain_and_synthetic_speculation_on_cpu(tmp_path, capsys):
    out = tmp_path / "shape.json"
    assert main(["bench", "--shape", "tiny", "--random-weights", "--device", "cpu", "--concurrency", "1,4",
                 "--max-tokens", "48", "--prompt-len", "32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {(r["batch"], r["method"]): r for r in report["rows"]}
    assert set(rows) == {(b, m) for b in (1, 4) for m in ("none", "eagle3 k=4 accept 0.6", "eagle3 k=4 accept 0.8")}
    for (_, method), row in rows.items():
        assert row["ms_per_token"] > 0 and row["tokens_per_s"] > 0
        if method != "none":  # accepted at rate r, k = 4 drafts: 1 + r + ... + r**4 tokens a step on average
            rate = float(method.split()[-1])
            assert row["acceptance_length"] == pytest.approx((1 - rate**5) / (1 - rate), abs=0.5)
    assert rows[(1, "eagle3 k=4 accept 0.8")]["acceptance_length"] > rows[(1, "eagle3 k=4 accept 0.6")]["acceptance_length"]
    assert sorted(map(int, report["verify_ratio"])) == list(range(1, 9))
    assert "verify cost at batch 1" in capsys.readouterr().out


def test_shape_errors_are_one_line(capsys):
    assert main(["bench", "--shape", "tiny"]) != 0
    assert "pass --random-weights" in capsys.readouterr().err
    assert main(["bench", "--shape", "gpt-9", "--random-weights"]) != 0
    assert "--shape 'gpt-9': not one of llama-3.1-8b, qwen3-8b, tiny" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "--shape", "tiny", "--random-weights", "--device", "cpu", "--step-modes", "eager,cuda-graph"]) != 0
        assert "step mode cuda-graph needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--random-weights", "--step-modes", "eager,graphs"]) != 0
    assert "--step-modes: 'graphs' is not one of" in capsys.readouterr().err
