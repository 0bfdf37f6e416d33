"""The import root maps the top-level folders, as the layout promises."""

from pathlib import Path

import draftsmith.convert
import draftsmith.models
import draftsmith.serve
import draftsmith.train
from helpers import REPO


def test_top_level_folders_are_draftsmith_subpackages():
    for module, folder in [(draftsmith.models, "models"), (draftsmith.serve, "serve"),
                           (draftsmith.train, "train"), (draftsmith.convert, "convert")]:
        assert Path(module.__file__).resolve().parent == REPO / folder
