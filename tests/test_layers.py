"""The package's layers read bottom-up: fsutil/settings -> data -> train -> evaluate -> report ->
studies -> config/cli. Every import of every module (at the top or inside a function, found in the
source, not by importing it) goes to the same layer or a lower one, and no modules import each
other in a circle."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "workflow" / "chexflow"
# top-level module or subpackage of chexflow -> its layer (a lower layer never imports a higher one)
LAYERS = {"__init__": 0, "fsutil": 0, "settings": 0, "host": 0, "data": 1, "train": 2, "evaluate": 3, "report": 4, "predict": 4,
          "studies": 5, "config": 6, "cli": 6, "__main__": 6, "profiles": 6}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()
LAYERS["errors"] = 0        # the refusals' exit statuses (chexflow.errors): every layer's exceptions are named there
LAYERS["watchdog"] = 0      # the stall watchdog (chexflow.watchdog): every long-running command marks its progress there


def _resolve(name: str) -> str | None:
    """The chexflow module an imported name lives in (``chexflow.data.nih.X`` -> ``chexflow.data.nih``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """chexflow modules ``module`` imports anywhere in its source (functions and TYPE_CHECKING included)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:      # relative: from the package, up level - 1
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            if n.startswith("chexflow"):
                target = _resolve(n)
                if target and target != module:
                    found.add(target)
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


GRAPH = {m: imports_of(m) for m in MODULES}


def test_every_module_has_a_layer():
    missing = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(LAYERS))
    assert not missing, f"give these top-level modules a layer in LAYERS: {missing}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_upward_import(module):
    up = sorted(t for t in GRAPH[module] if layer(t) > layer(module))
    assert not up, f"{module} (layer {layer(module)}) imports a higher layer: {up}"


def _cycle() -> list[str] | None:
    """One import circle of the graph (Tarjan would list all; one is enough to fail), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(GRAPH[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    cycle = _cycle()
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_check_sees_lazy_imports_and_circles(monkeypatch):
    """The checks would fail on the two arrows this layering removed: the trainer importing the
    evaluation's metrics (a function-level import counts too) and a circle through the registry."""
    graph = {m: set(t) for m, t in GRAPH.items()}
    graph["chexflow.train.trainer"].add("chexflow.evaluate.metrics")
    graph["chexflow.data.sources"].add("chexflow.data.registry")
    monkeypatch.setattr(__import__(__name__), "GRAPH", graph)
    assert layer("chexflow.evaluate.metrics") > layer("chexflow.train.trainer")
    assert _cycle() is not None
    src = "def f():\n    from chexflow.evaluate import metrics as M\n"
    tree_imports = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)}
    assert tree_imports == {"chexflow.evaluate"}


def test_runtime_package_does_not_import_the_installers():
    """The installers (envs/chexflow_install: Horovod build, SLURM plugin patch) are build tooling:
    they use the package (chexflow.fsutil), never the other way round."""
    users = sorted(m for m, path in MODULES.items()
                   if any(isinstance(node, (ast.Import, ast.ImportFrom))
                          and any(n.startswith("chexflow_install") for n in
                                  [getattr(node, "module", None) or "", *(a.name for a in node.names)])
                          for node in ast.walk(ast.parse(path.read_text()))))
    assert not users, f"runtime modules importing the installers: {users}"
    assert not [m for m in MODULES if m.startswith("chexflow.install")], "the installers live in envs/chexflow_install"
