"""`draftsmith datagen` rewrites assistant turns (and text continuations) with the target's own outputs."""

import json

from draftsmith.cli import main
from draftsmith.models.tokenizer import load_tokenizer
from draftsmith.serve import LLM, SamplingParams
from helpers import DEMO_MODEL


def test_chat_turns_are_regenerated_by_the_target(tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"conversations": [
        {"from": "human", "value": "Write a function that adds two numbers."},
        {"from": "gpt", "value": "someone else's answer"},
        {"from": "human", "value": "And one that subtracts."},
        {"from": "gpt", "value": "another foreign answer"}]}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert main(["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(out),
                 "--max-tokens", "16", "--temperature", "0", "--device", "cpu"]) == 0
    messages = json.loads(out.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1)
    first = llm.chat([messages[:1]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert messages[1]["content"] == first.outputs[0].text != "someone else's answer"
    second = llm.chat([messages[:3]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert messages[3]["content"] == second.outputs[0].text  # built on the model's own first answer


def test_text_records_get_model_continuations(tmp_path):
    source = tmp_path / "code.jsonl"
    source.write_text(json.dumps({"text": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert main(["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(out),
                 "--max-tokens", "12", "--prompt-tokens", "8", "--temperature", "0", "--device", "cpu"]) == 0
    record = json.loads(out.read_text())
    text, prompt = record["text"], record["prompt"]
    assert text.startswith("def add(a, b):") and len(text) > 20
    assert text.startswith(prompt) and len(load_tokenizer(DEMO_MODEL)(prompt, add_special_tokens=False).input_ids) == 8


def test_block_cut_prompts_end_mid_line_anywhere_in_the_file(tmp_path):
    import random

    from draftsmith.serve.apps.datagen import _opening

    body = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n\n" for i in range(12))
    source = tmp_path / "code.jsonl"
    source.write_text(json.dumps({"text": body}) + "\n")
    out = tmp_path / "regen.jsonl"
    assert main(["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(out), "--cut", "block",
                 "--seed", "3", "--max-tokens", "10", "--prompt-tokens", "6", "--temperature", "0"]) == 0
    record = json.loads(out.read_text())["text"]
    opening = _opening(body, "block", random.Random(3))
    assert body.startswith(opening) and len(opening) < len(body)
    assert opening.splitlines()[-1].startswith("    ")  # cut inside an indented line, not after a newline
    llm = LLM(DEMO_MODEL, dtype="float32", device="cpu", max_num_seqs=1)
    ids = llm.tokenizer(opening, add_special_tokens=False).input_ids
    continuation = llm.generate({"prompt_token_ids": ids[-6:]}, SamplingParams(temperature=0, max_tokens=10),
                                use_tqdm=False)[0].outputs[0].text
    assert record == llm.tokenizer.decode(ids[-6:]) + continuation


def test_skip_samples_regenerates_the_records_after_another_runs(tmp_path, capsys):
    source = tmp_path / "code.jsonl"
    source.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(5)))
    out = tmp_path / "regen.jsonl"
    args = ["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(out), "--max-tokens", "4",
            "--prompt-tokens", "4", "--temperature", "0"]
    assert main([*args, "--num-samples", "2", "--skip-samples", "2"]) == 0
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert [p[:6] for p in prompts] == ["def f2", "def f3"]
    assert main([*args, "--skip-samples", "5"]) == 2
    assert "holds 5 records: none left after skipping 5" in capsys.readouterr().err


def _recipe_with_datagen(tmp_path, runs) -> str:
    import yaml

    recipe = {"model": {"target": str(DEMO_MODEL), "head_type": "eagle3"},
              "data": {"train_files": [run.get("output", "x") for run in runs or [{}]], "format": "text"},
              "training": {"output_dir": str(tmp_path / "run")}, "datagen": runs}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_a_recipes_datagen_runs_as_its_flags_would(tmp_path, capsys):
    source = tmp_path / "code.jsonl"
    body = "".join(f"def f{i}(x):\n    return x * {i} + {i}\n\n\n" for i in range(6))
    source.write_text("".join(json.dumps({"text": body.replace("x", v)}) + "\n" for v in ("a", "b", "c")))
    runs = [{"input": str(source), "output": str(tmp_path / "top.jsonl"), "num_samples": 2, "prompt_tokens": 8,
             "max_tokens": 6, "temperature": 0},
            {"input": str(source), "output": str(tmp_path / "block.jsonl"), "skip_samples": 1, "cut": "block",
             "seed": 3, "prompt_tokens": 6, "max_tokens": 6, "temperature": 0, "enforce_eager": True}]
    recipe = _recipe_with_datagen(tmp_path, runs)
    # flags beside --recipe apply to every run, over the runs' own: even a default's value (--max-num-seqs 16)
    assert main(["datagen", "--recipe", recipe, "--max-tokens", "3", "--max-num-seqs", "16"]) == 0
    assert main(["datagen", "--model", str(DEMO_MODEL), "--input", str(source), "--output", str(tmp_path / "by-hand.jsonl"),
                 "--skip-samples", "1", "--cut", "block", "--seed", "3", "--prompt-tokens", "6", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    assert (tmp_path / "block.jsonl").read_text() == (tmp_path / "by-hand.jsonl").read_text()
    assert len((tmp_path / "top.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(["datagen", "--recipe", recipe]) == 0  # a rerun keeps what is there
    assert capsys.readouterr().out.count("exists: skipped") == 2


def test_a_recipes_datagen_mistakes_are_one_line(tmp_path, capsys):
    good = {"input": "in.jsonl", "output": str(tmp_path / "out.jsonl")}
    cases = [([good, {**good, "num_sampels": 3}], [], "datagen.1.num_sampels: Extra inputs are not permitted"),
             ([{"input": "in.jsonl"}], [], "datagen.0.output: Field required"),
             ([{**good, "cut": "middle"}], [], "datagen.0.cut"),
             ([{**good, "max_tokens": 0}], [], "datagen run 1: argument --max-tokens: must be >= 1, got 0"),
             ([good], ["--model", "m"], "--model: --recipe names them"),
             (None, [], "has no datagen list")]
    for runs, extra, message in cases:
        assert main(["datagen", "--recipe", _recipe_with_datagen(tmp_path, runs), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.jsonl").exists()  # nothing ran: every run is checked first
    assert main(["datagen", "--input", "in.jsonl"]) == 2
    assert "--model, --output required" in capsys.readouterr().err


def test_a_recipes_runs_take_any_datagen_flag_and_values_beginning_with_a_dash(tmp_path):
    from draftsmith.cli import build_parser
    from draftsmith.serve.apps.datagen import _given, recipe_runs
    from draftsmith.train.recipe import DatagenRun

    parser = build_parser()
    datagen = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["datagen"]
    assert set(DatagenRun.model_fields) == {a.dest for a in datagen._actions} - {"help", "recipe"}
    runs = [{"input": "-odd.jsonl", "output": str(tmp_path / "o.jsonl"), "engine": "vllm", "tensor_parallel_size": 8}]
    argv = ["datagen", "--recipe", _recipe_with_datagen(tmp_path, runs), "--engine", "draftsmith",
            "--tensor-parallel", "1"]  # argparse takes a flag's prefix
    assert _given(datagen, argv) == {"recipe", "engine", "tensor_parallel_size"}
    args = parser.parse_args(argv)
    args.argv = argv  # as `draftsmith.cli.main` hands it over
    (run,) = recipe_runs(args)
    assert (run.input, run.engine, run.tensor_parallel_size) == ("-odd.jsonl", "draftsmith", 1)
