"""Methods are found, not listed: every folder of draftsmith/methods registers one method, and every part a
method names by reference (`proposer_ref`, `objective_ref`, `acceptance_eval_ref`) resolves."""

from __future__ import annotations

import inspect

import pytest

from draftsmith.errors import DraftsmithError
from draftsmith.methods import METHODS, Proposer, SpecMethod
from draftsmith.methods.plugins import SHARED_SUBPACKAGES, register_plugin_methods
from helpers import REPO


def test_every_method_folder_registers_a_method():
    folders = {p.parent.name for p in (REPO / "draftsmith" / "methods").glob("*/__init__.py")} - SHARED_SUBPACKAGES
    modules = {method.__module__.rsplit(".", 1)[-1] for method in METHODS.values()}
    assert folders <= modules, f"folders registering no method: {sorted(folders - modules)}"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_reference_resolves(name):
    method = METHODS[name]
    proposer = method.proposer_class()
    assert proposer is None or (inspect.isclass(proposer) and issubclass(proposer, Proposer))
    for part in (method.objective(), method.acceptance_eval()):
        assert part is None or callable(part)
    assert (method.objective() is None) == (method.recipe_section is None)


def test_a_reference_is_relative_to_the_class_that_set_it():
    """A subclass defined elsewhere inherits its parent's relative reference as the parent meant it."""
    parent = METHODS["medusa"]
    child = type("Elsewhere", (parent,), {"__module__": __name__})
    assert child.proposer_class() is parent.proposer_class()
    assert SpecMethod.proposer_class() is None


def test_plugins_load_by_entry_point_and_fail_in_one_line(monkeypatch):
    class BrokenPoint:
        name, value, dist = "broken", "nowhere.at_all", None

        def load(self):
            raise ImportError("No module named 'nowhere'")

    monkeypatch.setattr("draftsmith.methods.plugins.entry_points", lambda group: [BrokenPoint()])
    with pytest.raises(DraftsmithError, match=r"^method plugin 'broken': importing nowhere.at_all failed: "
                                              r"ImportError: No module named 'nowhere'$"):
        register_plugin_methods()
    monkeypatch.setattr("draftsmith.methods.plugins.entry_points", lambda group: [])
    assert register_plugin_methods() == []
