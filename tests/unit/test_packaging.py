"""The import root maps the top-level folders, as the layout promises."""

from pathlib import Path

import pytest

import draftsmith.convert
import draftsmith.models
import draftsmith.serve
import draftsmith.train
from helpers import REPO


def test_top_level_folders_are_draftsmith_subpackages():
    for module, folder in [(draftsmith.models, "models"), (draftsmith.serve, "serve"),
                           (draftsmith.train, "train"), (draftsmith.convert, "convert")]:
        assert Path(module.__file__).resolve().parent == REPO / folder


def test_every_package_folder_is_in_the_distribution():
    """pyproject lists packages explicitly (the folders are remapped under `draftsmith.`); an editable install
    finds an unlisted subpackage anyway, a wheel would not, so a new method folder must be listed."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"draftsmith": REPO / "draftsmith", "draftsmith.models": REPO / "models", "draftsmith.serve": REPO / "serve",
             "draftsmith.train": REPO / "train", "draftsmith.convert": REPO / "convert"}
    found = set()
    for package, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(folder).parts]))
    assert found == listed


def test_make_bench_passes_valid_speculative_configs():
    """Every --speculative-config `make bench` hands the shell parses as JSON (a backslash-newline inside a
    quoted recipe argument reaches the shell as it is and had broken one)."""
    import json
    import shlex
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    recipe = subprocess.run(["make", "-n", "bench"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    words = shlex.split(recipe)  # as sh reads it: a backslash-newline inside quotes stays
    configs = [words[i + 1] for i, word in enumerate(words) if word == "--speculative-config"]
    assert len(configs) >= 3
    for config in configs:
        json.loads(config)
