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
