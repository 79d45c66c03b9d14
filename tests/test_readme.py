"""The README's Layout section stays true: every module its table of facts names exists and defines
the names it gives, and the layers it describes are the ones tests/test_layers.py enforces."""
from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "workflow" / "chexflow"


def layout() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Layout\n", 1)[1].split("\n## ", 1)[0]


def owners() -> list[tuple[str, str, list[str]]]:
    """(fact, module path, [names defined there]) for each module a row of the facts table names."""
    out = []
    for fact, cell in re.findall(r"^\| (.+?) \| (`.+`) \|$", layout(), re.M):
        module = None
        for token in re.findall(r"`([^`]+)`", cell):
            if token.endswith(".py"):
                module = token
                out.append((fact, module, []))
            else:
                assert module is not None, f"{fact}: {token!r} before any module"
                out[-1][2].append(token)
    return out


def defined(path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_fact_names_an_existing_owner():
    rows = owners()
    assert len(rows) >= 15
    for fact, module, names in rows:
        path = PACKAGE / module
        assert path.is_file(), f"README Layout, {fact!r}: {module} does not exist"
        missing = set(names) - defined(path)
        assert not missing, f"README Layout, {fact!r}: {module} defines no {sorted(missing)}"


def test_the_layers_described_are_the_ones_enforced():
    from test_layers import LAYERS
    text = layout()
    order = re.search(r"bottom up: (.+?)\. A module", text, re.S).group(1)
    described = [[m.strip("`") for m in step.split("/")] for step in re.findall(r"`[^`]+`(?:/`[^`]+`)?", order)]
    layers = [LAYERS[name] for step in described for name in step]
    assert layers == sorted(layers)
    assert {name for step in described for name in step} == set(LAYERS) - {"__init__", "__main__", "install"}
