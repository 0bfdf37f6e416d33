"""Packages are found, never listed by hand: every folder with an `__init__.py` under a folder that pyproject's
`[tool.setuptools.package-dir]` maps into `draftsmith` (models/ is draftsmith.models, and so on)."""

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # the build requires tomli there (pyproject's build-system)
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def draftsmith_packages() -> list[str]:
    roots = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = []
    for package, folder in roots.items():
        found += [package, *(f"{package}.{sub}" for sub in find_packages(where=str(HERE / folder)))]
    return sorted(set(found))


setup(packages=draftsmith_packages())
