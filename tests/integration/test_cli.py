"""The `draftsmith` CLI contract: output shape, metrics, and one-line errors naming the culprit."""

import json
import subprocess
import sys

import pytest

from draftsmith.cli import main
from helpers import DEMO_MODEL


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _generate(tmp_path, prompts, *extra):
    prompts_file = _write(tmp_path / "p.jsonl", prompts)
    return main(["generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts_file), "--output",
                 str(tmp_path / "out.jsonl"), "--max-tokens", "12", "--temperature", "0", "--device", "cpu", *extra])


def test_generate_writes_outputs_in_order_with_metrics(tmp_path):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    code = _generate(tmp_path, [{"prompt": "def add(a, b):\n    return"}, {"messages": messages},
                                {"prompt": "import o"}], "--metrics-json", str(tmp_path / "m.json"))
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"index", "text", "token_ids", "num_prompt_tokens", "finish_reason"}
    assert all(r["finish_reason"] in ("stop", "length") and 0 < len(r["token_ids"]) <= 12 for r in rows)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rows[1]["num_prompt_tokens"] == len(tokenizer(templated, add_special_tokens=False).input_ids)
    assert rows[2]["num_prompt_tokens"] == len(tokenizer("import o", add_special_tokens=False).input_ids)
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["num_generated_tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert metrics["elapsed_s"] > 0 and metrics["tokens_per_s"] > 0


def test_generate_takes_further_sampling_params(tmp_path, capsys):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    further = json.dumps({"presence_penalty": 1.5, "logit_bias": {"7": -100}, "structured_outputs": {"json": schema}})
    assert _generate(tmp_path, [{"prompt": "x = "}], "--sampling-params", further) == 0
    [row] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert set(json.loads(row["text"])) == {"n"} and 7 not in row["token_ids"]
    assert _generate(tmp_path, [{"prompt": "x"}], "--sampling-params", '{"presense_penalty": 1}') == 2
    assert "unknown fields ['presense_penalty']" in capsys.readouterr().err


@pytest.mark.parametrize("case,expected", [
    ("missing_model", "model directory '/nonexistent/model' does not exist"),
    ("bad_json", "p.jsonl line 2: not valid JSON"),
    ("bad_record", "p.jsonl line 1: expected \"prompt\""),
    ("too_long", "prompt 0: prompt has"),
    ("missing_prompts", "prompts file"),
])
def test_bad_input_is_one_line_naming_the_culprit(case, expected, tmp_path, capsys):
    prompts = {"bad_json": [{"prompt": "a"}, "{not json"], "bad_record": [{"text": "a"}],
               "too_long": [{"prompt": "x = 1\n" * 100}]}.get(case, [{"prompt": "a"}])
    prompts_file = _write(tmp_path / "p.jsonl", prompts)
    if case == "missing_prompts":
        prompts_file = tmp_path / "absent.jsonl"
    model = "/nonexistent/model" if case == "missing_model" else str(DEMO_MODEL)
    argv = ["generate", "--model", model, "--prompts", str(prompts_file), "--output", str(tmp_path / "o.jsonl"),
            "--max-tokens", "4", "--temperature", "0", "--device", "cpu", "--max-model-len", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


def test_console_script_rejects_unknown_dtype_in_one_line(tmp_path):
    prompts_file = _write(tmp_path / "p.jsonl", [{"prompt": "a"}])
    result = subprocess.run(
        [sys.executable, "-m", "draftsmith", "generate", "--model", str(DEMO_MODEL), "--prompts", str(prompts_file),
         "--output", str(tmp_path / "o.jsonl"), "--max-tokens", "4", "--temperature", "0", "--dtype", "float8"],
        capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--dtype" in result.stderr and "float8" in result.stderr


def test_demo_prints_text_and_throughput(capsys):
    assert main(["demo", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "def fibonacci(n):" in out and "tokens/s" in out and "mean acceptance length" in out
    assert "server stopped" in out
