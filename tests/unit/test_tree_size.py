"""The tracked tree travels to a lent GPU with every call (64 MiB at most, carried wheels included): it stays
at most 48 MiB, and the heads it ships are stored in bf16, as public checkpoints are."""

from __future__ import annotations

import json
import subprocess

import pytest
from safetensors import safe_open

from helpers import REPO

TREE_LIMIT = 48 * 2**20


def tracked_bytes() -> int:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked tree is what a clone holds")
    names = [name.decode() for name in listed.split(b"\0") if name]
    return sum((REPO / name).stat().st_size for name in names if (REPO / name).is_file())


def test_the_tracked_tree_leaves_room_for_the_wheels():
    size = tracked_bytes()
    assert size <= TREE_LIMIT, f"the tracked tree is {size / 2**20:.1f} MiB, over {TREE_LIMIT / 2**20:.0f} MiB"


def shipped_heads():
    return sorted(p for p in (REPO / "assets").iterdir()
                  if (p / "config.json").is_file() and "draftsmith_head_type" in json.loads((p / "config.json").read_text()))


def test_shipped_heads_are_bf16():
    heads = shipped_heads()
    assert len(heads) >= 4
    for head in heads:
        with safe_open(str(head / "model.safetensors"), framework="pt") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        assert dtypes - {"I64", "BOOL"} == {"BF16"}, f"{head.name}: {sorted(dtypes)}"
