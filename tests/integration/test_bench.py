"""`draftsmith bench`: the method x concurrency matrix, its JSON rows, chart and flag errors, on a tiny run."""

import json
import statistics

import pytest

from draftsmith.cli import build_parser, main
from draftsmith.models.loader import load_target
from draftsmith.serve.bench import matrix as bench
from draftsmith.serve.speculation import cost_profile
from helpers import DEMO_MODEL, shared_path

LEVELS = (1, 2)


@pytest.fixture
def shared_with_demo(tmp_path, monkeypatch):
    """A shared folder whose only model is the embedded demo one (the prompts still come from ../shared), and
    a synthetic forward-cost table for it: measuring the real one takes longer than this whole test, and
    the test checks the matrix, not which k the adaptive policy picks."""
    root = tmp_path / "shared"
    (root / "models").mkdir(parents=True)
    (root / "data").symlink_to(shared_path("data", "code-validation.jsonl.xz").parent)
    (root / "models" / "demo-code-7m").symlink_to(DEMO_MODEL)
    monkeypatch.setenv("DRAFTSMITH_CACHE_DIR", str(tmp_path / "cache"))  # keep the table out of other tests
    target = load_target(DEMO_MODEL, dtype="float32", device="cpu", max_len=64)
    key = cost_profile.profile_key(DEMO_MODEL, target)
    # a small CPU target: a verify of q tokens costs far less than q decodes, rows cost less than linear
    seconds = [[1e-3 * (1 + 0.6 * (r - 1)) * (1 + 0.15 * (q - 1)) for q in cost_profile.QUERY_LENS]
               for r in cost_profile.ROWS]
    table = cost_profile.ForwardCostTable(key, list(cost_profile.ROWS), list(cost_profile.QUERY_LENS),
                                          cost_profile.CONTEXT, seconds)
    path = cost_profile.cache_path(key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(table.to_json()))
    return root


def test_bench_writes_a_row_per_method_and_level_and_a_chart(shared_with_demo, tmp_path, capsys):
    out = tmp_path / "out" / "bench.json"
    args = build_parser().parse_args([
        "bench", "--shared", str(shared_with_demo), "--models", "demo-code-7m",
        "--concurrency", ",".join(map(str, LEVELS)), "--num-prompts", "2", "--max-tokens", "8", "--no-hf",
        "--profile", "--json", str(out)])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())
    methods = ["none", *bench.speculation_methods("demo-code-7m", args.speculative_config, args.head_k)]
    assert len(methods) >= 2  # n-gram by default, plus the shipped EAGLE-3 head
    assert sorted((r["method"], r["concurrency"]) for r in rows) == sorted(
        (m, c) for m in methods for c in LEVELS)
    no_spec = {r["concurrency"]: r for r in rows if r["method"] == "none"}
    for row in rows:
        assert row["model"] == "demo-code-7m" and row["tokens_per_s"] > 0
        assert row["greedy_equal"] is True, row
        reference = no_spec[row["concurrency"]]
        assert row["speedup_vs_no_spec"] == pytest.approx(
            bench.paired_ratio(row["tokens_per_s_by_round"], reference["tokens_per_s_by_round"]))
        assert row["whole_run_speedup_vs_no_spec"] == pytest.approx(
            bench.paired_ratio(row["whole_run_tokens_per_s_by_round"], reference["whole_run_tokens_per_s_by_round"]))
        assert row["tokens_per_s"] == pytest.approx(statistics.median(row["tokens_per_s_by_round"]))
        assert 0 < row["prefill_share"] < 1  # every level prefills its prompts, and decodes 8 tokens each
        if row["method"] != "none":
            assert row["k"] >= 1 and row["mean_acceptance_length"] >= 1.0
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    printed = capsys.readouterr().out
    assert "demo-code-7m: tok/s with c requests in flight and speedup" in printed and "c=2" in printed
    assert "of the run (speculation's ceiling" in printed


def test_methods_choose_the_rows_and_repeat_sends_the_prompts_again(shared_with_demo, tmp_path, capsys):
    out = tmp_path / "bench.json"
    base = ["bench", "--shared", str(shared_with_demo), "--models", "demo-code-7m", "--concurrency", "1",
            "--num-prompts", "1", "--max-tokens", "8", "--no-hf", "--no-plot"]
    args = build_parser().parse_args([*base, "--methods", "ngram", "--repeat", "2", "--json", str(out)])
    sizes, drive = [], bench.drive
    bench.drive = lambda llms, batch, params, c: sizes.append(len(batch)) or drive(llms, batch, params, c)
    try:
        assert bench.run(args) == 0
    finally:
        bench.drive = drive
    assert sizes == [2 * bench.level_prompts(args, 1)]  # the level's prompts, twice
    assert sorted(r["method"] for r in json.loads(out.read_text())) == ["ngram", "none"]
    assert "the prompts sent 2 times" in capsys.readouterr().out
    assert main([*base, "--methods", "lookahead"]) == 2
    assert "--methods lookahead: not run for demo-code-7m" in capsys.readouterr().err
    # a config the user gave is never dropped in silence by --methods
    assert main([*base, "--methods", "none", "--speculative-config", '{"method": "ngram"}']) == 2
    assert "--speculative-config gives ngram, which --methods (none) leaves out" in capsys.readouterr().err


def test_control_times_a_second_plain_engine_that_the_peer_does_not_run(shared_with_demo, tmp_path, capsys):
    """--control: a row none-control, a second engine without speculation timed in turns with the others
    (its ratio is the run's noise floor), generating what no speculation does; a peer is not asked to run it."""
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "bench", "--shared", str(shared_with_demo), "--models", "demo-code-7m", "--concurrency", "1",
        "--num-prompts", "1", "--max-tokens", "8", "--no-hf", "--no-plot", "--methods", "ngram", "--control",
        "--json", str(out)])
    assert bench.run(args) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["ngram", "none", bench.CONTROL]
    control = rows[bench.CONTROL]
    assert control["k"] is None and control["greedy_equal"] and control["tokens_per_s"] > 0
    assert control["speedup_vs_no_spec"] == pytest.approx(control["tokens_per_s"] / rows["none"]["tokens_per_s"])  # one round
    assert bench.CONTROL in capsys.readouterr().out

    class Peer:  # what bench_model asks of `bench.peer.Peer`
        def session(self, args, model_dir, configs, batches):
            self.configs = configs
            return None

    peer = Peer()
    bench.bench_model(args, "demo-code-7m", [1], bench.bench_texts(args, 1)[0], peer)
    assert sorted(peer.configs) == ["ngram", "none"]


def test_the_edit_workload_asks_to_rewrite_whole_files(shared_with_demo, tmp_path, capsys):
    from draftsmith.corpus import EDIT_INSTRUCTION, edit_prompts

    data = shared_with_demo / "data" / "code-validation.jsonl.xz"
    prompts = edit_prompts(data, 3)
    for prompt in prompts:
        file, rewrite = prompt.split(EDIT_INSTRUCTION)
        assert 600 <= len(file) <= 2000 and rewrite == file.split("\n", 1)[0] + "\n"
    args = build_parser().parse_args(["bench", "--shared", str(shared_with_demo), "--models", "demo-code-7m",
                                      "--concurrency", "1", "--num-prompts", "1", "--max-tokens", "8", "--no-hf",
                                      "--no-plot", "--methods", "ngram", "--workload", "edit"])
    assert bench.run(args) == 0
    assert "validation code-edit prompts per level" in capsys.readouterr().out


@pytest.mark.parametrize("levels,expected", [("0", "levels must be >= 1, got 0"), ("a", "'a' is not an integer"),
                                             ("1,,4", "'' is not an integer")])
def test_bad_concurrency_is_one_line_naming_the_flag(levels, expected, capsys):
    assert main(["bench", "--shared", "/nonexistent", "--concurrency", levels, "--no-hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--concurrency" in err[0] and expected in err[0], err
