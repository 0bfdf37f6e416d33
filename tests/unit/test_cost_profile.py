"""The forward-cost profile: interpolation, the on-disk cache keyed by model/device/dtype, `draftsmith profile`.
Nothing here asserts how fast anything is; the table's values are whatever this machine measured."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.models import load_target
from draftsmith.serve.speculation import cost_profile
from draftsmith.serve.speculation.cost_profile import (
    ForwardCostTable,
    cache_path,
    load_or_profile,
    profile_key,
)
from helpers import DEMO_MODEL

GRID = {"rows": (1, 2), "query_lens": (1, 3), "context": 16}


def test_estimate_interpolates_and_extrapolates_linearly():
    table = ForwardCostTable({}, [1, 4], [1, 3], 0, [[1.0, 2.0], [4.0, 8.0]])
    assert table.estimate(1, 1) == 1.0 and table.estimate(4, 3) == 8.0  # measured points as they are
    assert table.estimate(1, 2) == pytest.approx(1.5)
    assert table.estimate(2, 1) == pytest.approx(2.0)  # a third of the way from 1 to 4 rows
    assert table.estimate(4, 5) == pytest.approx(12.0)  # past the grid: the last slope continues
    assert table.estimate(7, 1) == pytest.approx(7.0)


def test_a_point_timed_above_a_larger_shape_is_priced_as_the_larger():
    """Timing noise only adds time: a verify shape measured dearer than a longer one of the same rows, or than
    the same shape with more rows, is priced as that one; a decode keeps its own time, and so does the table."""
    measured = [[3.0, 2.8, 2.8, 4.5, 2.9, 3.2],   # 1 row: 4 tokens timed in a busy moment; the decode dearer
                [3.1, 3.0, 2.7, 3.3, 3.4, 3.9],   # 2 rows: 2 tokens dearer than 3
                [3.2, 3.1, 3.3, 3.2, 3.6, 4.4]]   # 4 rows: 3 tokens dearer than 4 (and than 2 rows' 3)
    table = ForwardCostTable({}, [1, 2, 4], [1, 2, 3, 4, 5, 8], 0, measured)
    priced = [[table.estimate(r, q) for q in table.query_lens] for r in table.rows]
    assert priced == [[3.0, 2.7, 2.7, 2.9, 2.9, 3.2],
                      [3.1, 2.7, 2.7, 3.2, 3.4, 3.9],
                      [3.2, 3.1, 3.2, 3.2, 3.6, 4.4]]
    assert table.estimate(1, 6) == pytest.approx(3.0)  # a third of the way from the priced 5 to 8
    assert table.seconds == measured  # what `draftsmith profile` prints and the cache keeps


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty profile cache on a machine that reads as quiet: whether a profile is saved must not depend on
    what else CI runs meanwhile (a test that wants a busy machine says so itself)."""
    monkeypatch.setenv("DRAFTSMITH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_profile, "wait_for_quiet", lambda **kwargs: 0.0)
    monkeypatch.setattr(cost_profile.OthersBusy, "cores", lambda self: 0.0)
    return tmp_path


def test_profile_is_measured_once_then_reused(cache_dir, monkeypatch):
    model = load_target(DEMO_MODEL, dtype="float32")
    table, cached = load_or_profile(model, DEMO_MODEL, **GRID)
    assert not cached and table.rows == [1, 2] and table.query_lens == [1, 3]
    assert all(s > 0 for line in table.seconds for s in line)
    path = cache_path(table.key)
    assert path.parent == cache_dir / "profiles" and json.loads(path.read_text())["seconds"] == table.seconds

    def no_profile(*args, **kwargs):
        raise AssertionError("a matching saved profile must be reused, not measured again")

    monkeypatch.setattr(cost_profile, "profile_forwards", no_profile)
    again, cached = load_or_profile(model, DEMO_MODEL, **GRID)
    assert cached and again == table
    with pytest.raises(AssertionError, match="reused"):  # another grid is measured anew
        load_or_profile(model, DEMO_MODEL, rows=(1, 2, 4), query_lens=(1, 3), context=16)


def test_the_default_grid_named_is_the_table_an_engine_reads(cache_dir, monkeypatch):
    """`draftsmith profile MODEL --refresh` names the grid (rows up to --max-rows, --context): at the defaults,
    it must measure again the table engines price with, not a file of its own."""
    model = load_target(DEMO_MODEL, dtype="float32")
    rows, lens = cost_profile.ROWS, cost_profile.QUERY_LENS
    monkeypatch.setattr(cost_profile, "profile_forwards", lambda model, key, rows=rows, query_lens=lens,
                        context=cost_profile.CONTEXT, progress=None: ForwardCostTable(
                            key, list(rows), list(query_lens), context, [[1e-3] * len(query_lens)] * len(rows)))
    monkeypatch.setattr(cost_profile, "stale_by", lambda model, table: None)
    named, cached = load_or_profile(model, DEMO_MODEL, refresh=True, rows=rows, context=cost_profile.CONTEXT)
    assert not cached
    again, cached = load_or_profile(model, DEMO_MODEL)
    assert cached and cache_path(again.key) == cache_path(named.key)


def test_one_models_tables_of_two_grids_are_kept_apart(cache_dir, monkeypatch):
    """A draft model is often another engine's target: the grid that prices its catch-ups must not overwrite
    the default one in the cache, nor the other way round."""
    model = load_target(DEMO_MODEL, dtype="float32")
    other = {"rows": (1,), "query_lens": (1, 4), "context": 0}
    first, _ = load_or_profile(model, DEMO_MODEL, **GRID)
    second, _ = load_or_profile(model, DEMO_MODEL, **other)
    assert cache_path(first.key) != cache_path(second.key)

    def no_profile(*args, **kwargs):
        raise AssertionError("a matching saved profile must be reused, not measured again")

    monkeypatch.setattr(cost_profile, "profile_forwards", no_profile)
    assert load_or_profile(model, DEMO_MODEL, **GRID) == (first, True)
    assert load_or_profile(model, DEMO_MODEL, **other) == (second, True)


def test_a_saved_profile_that_live_forwards_disagree_with_is_measured_again(cache_dir):
    """A table saved from a busy machine (every forward 30x slower than now) is not trusted: live forwards of
    a decode and a verify shape disagree, so the table is measured again and saved over it."""
    model = load_target(DEMO_MODEL, dtype="float32")
    table, _ = load_or_profile(model, DEMO_MODEL, **GRID)
    path = cache_path(table.key)
    saved = json.loads(path.read_text())
    saved["seconds"] = [[30 * s for s in line] for line in saved["seconds"]]
    path.write_text(json.dumps(saved))
    again, cached = load_or_profile(model, DEMO_MODEL, **GRID)
    assert not cached and again.seconds[0][0] < saved["seconds"][0][0] / 2
    assert json.loads(path.read_text())["seconds"] == again.seconds


def test_a_profile_taken_while_other_processes_are_busy_is_not_saved(cache_dir, monkeypatch):
    monkeypatch.setattr(cost_profile.OthersBusy, "cores", lambda self: 1.0)  # a core used elsewhere throughout
    model = load_target(DEMO_MODEL, dtype="float32")
    table, cached = load_or_profile(model, DEMO_MODEL, **GRID)
    assert not cached and all(s > 0 for line in table.seconds for s in line)
    assert not cache_path(table.key).exists()


def test_profiles_are_kept_apart_by_dtype_and_model():
    model = load_target(DEMO_MODEL, dtype="float32")
    key = profile_key(DEMO_MODEL, model)
    assert key["dtype"] == "float32" and key["torch"] == torch.__version__
    assert cache_path(key) != cache_path({**key, "dtype": "bfloat16"})
    assert cache_path(key) != cache_path({**key, "model": "/elsewhere"})


def test_the_key_names_the_linear_form_without_loading_kernels_turned_off(monkeypatch):
    """The key says which linear layers run ("panel" where fp32 layers take the panel GEMM); working that out
    loads the C++ build only where the engine would (not under DRAFTSMITH_ATTENTION=torch, which keeps the
    build, and with it the panel GEMM and the step ops, out of the process)."""
    from draftsmith.models import linear, slot_attention_cpu

    model = load_target(DEMO_MODEL, dtype="float32")
    built = slot_attention_cpu.build_error() is None  # loaded for real first: the spy below builds nothing
    builds = []
    monkeypatch.setattr(slot_attention_cpu, "build_error", lambda: builds.append(1))
    monkeypatch.setattr(slot_attention_cpu, "LOADED", False)
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "torch")
    assert profile_key(DEMO_MODEL, model)["cpu_linear"] in ("onednn", "aten")
    assert not builds and not slot_attention_cpu.LOADED
    monkeypatch.setenv("DRAFTSMITH_ATTENTION", "auto")
    profile_key(DEMO_MODEL, model)
    assert builds  # where the engine would load it, so does the key
    if built:
        monkeypatch.setattr(slot_attention_cpu, "LOADED", True)
        expected = "panel" if linear.panels_run(torch.float32) else "onednn"
        assert profile_key(DEMO_MODEL, model)["cpu_linear"] == expected


@pytest.mark.slow
def test_profile_command_prints_the_table_and_reuses_it(cache_dir, capsys):
    argv = ["profile", str(DEMO_MODEL), "--max-rows", "2", "--context", "16", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rows \\ query" in out and "saved:" in out and "(1.00)" in out
    assert main(argv) == 0
    assert "reused:" in capsys.readouterr().out
    assert main(["profile", str(cache_dir / "missing")]) == 2
