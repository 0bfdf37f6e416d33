"""Finding methods: the folders of `draftsmith.methods`, and the `draftsmith.methods` entry points of other
installed distributions. Importing a method's module registers it (`@register_method`); nothing lists them.

A plugin declares, in its own pyproject.toml:

    [project.entry-points."draftsmith.methods"]
    my_method = "my_package.my_method"

and `my_package/my_method` holds what a built-in method's folder holds: the registered `SpecMethod` with its
sections and needs, and the proposer, objective, head and converter modules its `*_ref`s and `converters` name.
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from draftsmith.errors import DraftsmithError

ENTRY_POINT_GROUP = "draftsmith.methods"
# subpackages of draftsmith.methods that every method shares rather than one method each
SHARED_SUBPACKAGES = frozenset({"formats"})


def register_builtin_methods(package: str, path: list[str]) -> list[str]:
    """Imports every subpackage of `package` (draftsmith.methods, whose folders are `path`) but the shared
    ones, each a method -> their names."""
    names = sorted(info.name for info in pkgutil.iter_modules(path)
                   if info.ispkg and info.name not in SHARED_SUBPACKAGES)
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names


def register_plugin_methods() -> list[str]:
    """Imports the module of every `draftsmith.methods` entry point installed -> their names. A plugin that
    fails to import stops the process with a one-line error naming it: a method that silently went missing
    would surface later as an "unknown method"."""
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda point: point.name)
    for point in found:
        try:
            point.load()
        except Exception as exc:  # any error of someone else's module, said in one line
            where = f" (from {point.dist.name})" if point.dist is not None else ""
            raise DraftsmithError(f"method plugin {point.name!r}{where}: importing {point.value} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
    return [point.name for point in found]
