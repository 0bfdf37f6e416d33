"""The package's layers: no import cycles among its modules, and training and conversion never load serving.

The graph counts every import statement, at module level or inside a function (a deferred import is still
a dependency), and a method's `*_ref` ("module:name", loaded when asked); it resolves `from package import
name` to the submodule when `name` is one.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import draftsmith
from helpers import REPO

ROOTS = {"draftsmith": REPO / "draftsmith", "draftsmith.models": REPO / "models", "draftsmith.serve": REPO / "serve",
         "draftsmith.train": REPO / "train", "draftsmith.convert": REPO / "convert"}


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if package == "draftsmith" and parts[:1] in (["models"], ["serve"], ["train"], ["convert"]):
                continue  # not there: those live in their own top-level folders
            found[name] = path
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                    isinstance(t, ast.Name) and t.id.endswith("_ref") for t in node.targets):
                targets = [_referenced_module(node.value.value, name, is_package)]  # SpecMethod.*_ref
            for target in targets:
                while target and target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _referenced_module(ref: str, module: str, is_package: bool) -> str:
    """The module a method's `*_ref` ("module:name", "." relative to the declaring module) loads."""
    target = ref.partition(":")[0]
    if not target.startswith("."):
        return target
    anchor = module.split(".") if is_package else module.split(".")[:-1]
    level = len(target) - len(target.lstrip("."))
    return ".".join(anchor[: len(anchor) - level + 1] + [target.lstrip(".")])


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, result, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return result


def _reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def test_graph_sees_the_whole_package():
    graph = _import_graph()
    assert {"draftsmith.methods.eagle.proposer", "draftsmith.serve.engine.core", "draftsmith.train.trainer",
            "draftsmith.convert.cli", "draftsmith.models.llama"} <= set(graph)
    # deferred loads count: the method class names its proposer (`proposer_ref`), loaded only when asked
    assert "draftsmith.methods.eagle.proposer" in graph["draftsmith.methods.eagle"]
    assert "draftsmith.methods.eagle.proposer" in graph["draftsmith.methods.mtp"]
    assert Path(draftsmith.__file__).parent == REPO / "draftsmith"


def test_no_import_cycles():
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_train_and_convert_never_reach_the_serving_package():
    graph = _import_graph()
    for name in graph:
        if name.startswith(("draftsmith.train", "draftsmith.convert")):
            serving = sorted(m for m in _reachable(graph, name) if m.startswith("draftsmith.serve"))
            assert serving == [], f"{name} reaches {serving}"


@pytest.mark.slow
def test_training_and_conversion_run_without_loading_serving_code():
    """The same, as Python sees it: import the trainer and convert CLI, resolve every method's objective
    and every converter format, and check no `draftsmith.serve` module was loaded."""
    code = (
        "import sys\n"
        "import draftsmith.train.trainer, draftsmith.train.cli, draftsmith.train.capture, draftsmith.convert.cli\n"
        "from draftsmith.methods.formats.registry import load_formats\n"
        "from draftsmith.methods import METHODS\n"
        "load_formats()\n"
        "[m.objective() for m in METHODS.values()]\n"
        "print(sorted(m for m in sys.modules if m.startswith('draftsmith.serve')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _layer(module: str) -> str:
    """Foundation (errors, corpus) < models < methods < train, convert, serve < entry points (the CLI, the
    developer tools of `draftsmith.tools`)."""
    if module in ("draftsmith.cli", "draftsmith.__main__") or module.startswith("draftsmith.tools"):
        return "entry"
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("models", "methods", "train", "convert", "serve"):
        return parts[1]
    return "foundation"


def test_layers_form_no_cycle_and_methods_depend_only_on_models():
    graph = _import_graph()
    layers: dict[str, set[str]] = {}
    for name, targets in graph.items():
        layers.setdefault(_layer(name), set()).update(_layer(t) for t in targets if _layer(t) != _layer(name))
    for layer in ("foundation", "models", "methods", "train", "convert", "serve", "entry"):
        layers.setdefault(layer, set())
    assert _cycles(layers) == []
    assert layers["models"] <= {"foundation"}
    assert layers["methods"] <= {"foundation", "models"}  # a method's folder never imports the engine or trainer
