"""Bench prompts split by repository: code from repositories the training split lacks, several windows a file."""

import json

import pytest

from draftsmith.corpus import WINDOW_GAP, code_windows, held_out_code_prompts, held_out_records
from draftsmith.errors import DraftsmithError


def _module(name: str, functions: int) -> str:
    return "".join(f"def {name}_{i}(value):\n    total = value * {i} + len(str(value))\n    return total\n\n"
                   for i in range(functions))


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def splits(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"path": "alpha/a.py", "text": _module("a", 5)},
                                              {"path": "beta/b/c.py", "text": _module("b", 5)}])
    validation = _write(tmp_path / "validation.jsonl", [
        {"path": "alpha/other.py", "text": _module("seen", 200)},
        {"path": "gamma/g.py", "text": _module("gamma", 200)},
        {"path": "delta.py", "text": _module("delta", 200)}])
    return validation, train


def test_only_repositories_missing_from_training_are_held_out(splits):
    assert [r["path"] for r in held_out_records(*splits)] == ["gamma/g.py", "delta.py"]


def test_windows_of_one_file_never_hold_the_code_after_another_window():
    text = _module("w", 300)
    windows = code_windows(text, 600, 2000)
    assert len(windows) > 3
    ends = []
    for window in windows:
        start = text.index(window)
        assert start == 0 or text[start - 1] == "\n"  # each starts on a line
        ends.append((start, start + len(window)))
    for (_, end), (next_start, _) in zip(ends, ends[1:]):
        assert next_start >= end + WINDOW_GAP


def test_held_out_prompts_take_each_file_in_turn(splits):
    prompts = held_out_code_prompts(*splits, num_prompts=4, min_chars=600, max_chars=2000)
    assert len(prompts) == 4
    assert ["gamma_" in p for p in prompts] == [True, False, True, False]
    assert not any("seen_" in p for p in prompts)


def test_no_held_out_repository_is_a_one_line_error(tmp_path):
    train = _write(tmp_path / "train.jsonl", [{"path": "alpha/a.py", "text": _module("a", 5)}])
    validation = _write(tmp_path / "validation.jsonl", [{"path": "alpha/b.py", "text": _module("b", 100)}])
    with pytest.raises(DraftsmithError, match="no code from a repository"):
        held_out_code_prompts(validation, train, 3)

