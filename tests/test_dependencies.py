"""Dependencies: every module a rule's command imports is declared in that rule's conda env, and
every third-party module the package imports is declared in pyproject.toml and installed by
envs/requirements.txt.

Where each fact lives:
  pyproject.toml          the names (and lower bounds): ``dependencies`` for every command, one
                          optional group per rule family (data, train, report), ``workflow``
                          (Snakemake) and ``test``;
  envs/requirements.txt   the exact pins of the workstation/CI install, and ``-e .[<every group>]``;
  envs/{data,train,report}.yaml
                          a rule family's conda env: ``-e ..[<its group>]``, torch and
                          torchvision where it needs them, and every pin as in
                          envs/requirements.txt.
torch and torchvision are deliberately not in pyproject.toml: envs/setup.sh installs the pinned
build from envs/requirements.txt, or keeps a cluster's own CUDA build (CHEXFLOW_SKIP_TORCH=1).
Horovod is built against that torch by ``python -m chexflow_install.horovod`` (envs/chexflow_install; envs/setup.sh runs
it; the train env file says to). The tests hold them to exactly that.

What a command imports is found from its source, not by importing it: chexflow imports numpy,
pandas, torch and psutil inside the functions that use them (so that the Snakefile and the CLI
start fast), which an import of the command's modules would never see (psutil, imported by
`chexflow launch` only when it stops ranks, was missing from envs/train.yaml exactly so). From the
command's ``cmd_*`` function in chexflow/cli.py, every function or class that a reached one names
is reached too (by name: this errs towards more), every reached module's top level runs, and
every import in what is reached counts (not under ``if TYPE_CHECKING``), as do packages looked up
by name (``find_spec("torchxrayvision")``) and the commands it starts (``["chexflow", "train"]``).
Only what chexflow imports itself is checked: what a library imports is its own requirements'
business (a fresh interpreter's sys.modules also holds what libraries import only if present,
e.g. joblib takes psutil when it finds it, so it would demand packages nothing needs).
"""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import REPO

WORKFLOW = REPO / "workflow"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
REQUIREMENTS = REPO / "envs" / "requirements.txt"
SETUP_SH = REPO / "envs" / "setup.sh"
# installed outside pyproject.toml (see the module docstring)
PINNED_OUTSIDE = {"torch", "torchvision"}          # pinned in envs/requirements.txt and the conda envs
BUILT_OUTSIDE = {"horovod": "chexflow_install.horovod"}   # built by this installer (envs/)
OWN = {"chexflow", "chexflow_install"}     # the package and its installers (envs/chexflow_install)


# --------------------------------------------------------------------------- what the code imports
def _module_file(name: str) -> Path | None:
    rel = Path(*name.split("."))
    for path in (WORKFLOW / rel.with_suffix(".py"), WORKFLOW / rel / "__init__.py"):
        if path.is_file():
            return path
    return None


def _walk_skipping_type_checking(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.orelse:
                yield sub
                yield from _walk_skipping_type_checking(sub)
            continue
        yield node
        yield from _walk_skipping_type_checking(node)


def _imports_in(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(dotted modules imported or looked up by name, chexflow subcommands started) in ``tree``."""
    modules, commands = set(), set()
    for node in _walk_skipping_type_checking(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:   # `from chexflow.data import shards` imports a module
                sub = f"{node.module}.{a.name}"
                modules.add(sub if sub.startswith("chexflow") and _module_file(sub) else node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("find_spec", "import_module") and node.args and isinstance(node.args[0], ast.Constant)):
            modules.add(node.args[0].value)
        elif isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            commands.update(b for a, b in zip(words, words[1:]) if a == "chexflow" and isinstance(b, str))
    return modules, commands


@cache
def _cli() -> tuple[ast.Module, dict[str, str]]:
    """chexflow/cli.py's tree and its subcommands: ``{"train": "cmd_train", ...}``."""
    tree = ast.parse((WORKFLOW / "chexflow" / "cli.py").read_text())
    subcommands, name = {}, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser":
            name = node.args[0].value
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "set_defaults":
            subcommands[name] = next(k.value.id for k in node.keywords if k.arg == "func")
    return tree, subcommands


@cache
def _units(module: str) -> dict[str, ast.AST]:
    """A chexflow module's top-level functions and classes by name; "" is the rest of its top level
    (what importing it runs)."""
    path = _module_file(module)
    assert path is not None, f"{module}: no such module under {WORKFLOW}"
    tree = ast.parse(path.read_text())
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    units: dict[str, ast.AST] = {n.name: n for n in tree.body if isinstance(n, defs)}
    units[""] = ast.Module([n for n in tree.body if not isinstance(n, defs)], [])
    return units


def _names_used(node: ast.AST) -> set[str]:
    names = set()
    for n in _walk_skipping_type_checking(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.ImportFrom):
            names.update(a.asname or a.name for a in n.names)
    return names


@cache
def command_imports(subcommand: str) -> frozenset[str]:
    """Every dotted module ``chexflow <subcommand>`` may import, chexflow's own and third-party.

    From the subcommand's ``cmd_*`` function, a function or class counts as run when a run one
    names it (by name alone, so this errs towards more); a module's top level counts once the
    module is imported; the imports in what runs are the command's, and so are those of any
    ``chexflow <other>`` it starts.
    """
    tree, subcommands = _cli()
    assert subcommand in subcommands, f"no subcommand {subcommand!r} in chexflow/cli.py"
    modules, names, started = set(), set(), set()
    todo, done = [("chexflow.cli", ""), ("chexflow.cli", subcommands[subcommand])], set()
    while todo:
        unit = todo.pop()
        if unit in done:
            continue
        done.add(unit)
        node = _units(unit[0])[unit[1]]
        found, commands = _imports_in(node)
        modules |= found
        names |= _names_used(node)
        started |= commands - {subcommand}
        own = {m for m in modules if m.split(".")[0] == "chexflow"}
        own |= {".".join(m.split(".")[:i]) for m in own for i in range(1, m.count(".") + 1)}
        todo += [(m, u) for m in own for u in _units(m) if u == "" or u in names]
    modules = {m for m in modules if not m.startswith("chexflow") or _module_file(m)}
    for other in started:
        modules |= command_imports(other)
    return frozenset(modules)


def third_party(modules) -> set[str]:
    tops = {m.split(".")[0] for m in modules}
    return {t for t in tops if t not in OWN and t not in sys.stdlib_module_names}


@cache
def _module_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def distribution(module: str) -> str:
    dists = _module_distributions().get(module)
    assert dists, f"no installed distribution provides the module {module!r}"
    return canonicalize_name(dists[0])


# --------------------------------------------------------------------------- what the files declare
def pyproject_requirements() -> dict[str, list[Requirement]]:
    """``{"": dependencies, group: its optional dependencies}``."""
    groups = {"": PYPROJECT["project"]["dependencies"], **PYPROJECT["project"]["optional-dependencies"]}
    return {g: [Requirement(r) for r in reqs] for g, reqs in groups.items()}


def pyproject_groups() -> dict[str, set[str]]:
    """``{"": dependencies, group: optional dependencies}``, canonical distribution names."""
    return {g: {canonicalize_name(r.name) for r in reqs} for g, reqs in pyproject_requirements().items()}


def _chexflow_with(extras: str) -> set[str]:
    groups = pyproject_groups()
    names = set(groups[""])
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        assert extra in groups, f"no optional-dependencies group {extra!r} in pyproject.toml"
        names |= groups[extra]
    return names


def _pip_line(line: str, editable_dir: str) -> tuple[set[str], dict[str, str]]:
    """(names, exact pins) of one requirements line; ``-e <editable_dir>[extras]`` is chexflow."""
    line = line.split(" #")[0].strip()
    if not line or line.startswith("#"):
        return set(), {}
    m = re.fullmatch(r"-e\s+(\S+?)(?:\[([^\]]*)\])?", line)
    if m:
        assert m.group(1) == editable_dir, f"editable install of {m.group(1)!r}, expected {editable_dir!r}"
        return {"chexflow"} | _chexflow_with(m.group(2) or ""), {}
    req = Requirement(line)
    name = canonicalize_name(req.name)
    pins = {name: s.version for s in req.specifier if s.operator == "=="}
    return {name}, pins


def requirements_txt() -> tuple[set[str], dict[str, str]]:
    names, pins = set(), {}
    for line in REQUIREMENTS.read_text().splitlines():
        n, p = _pip_line(line, ".")
        names |= n
        pins |= p
    return names, pins


def conda_env(path: Path) -> tuple[set[str], dict[str, str]]:
    """(names, exact pins) a conda env file installs: its conda packages and its pip section."""
    names, pins = set(), {}
    for dep in yaml.safe_load(path.read_text())["dependencies"]:
        if isinstance(dep, dict):
            for line in dep["pip"]:
                n, p = _pip_line(line, "..")
                names |= n
                pins |= p
        else:
            names.add(canonicalize_name(re.split(r"[=<>! ]", dep)[0]))
    return names, pins


# --------------------------------------------------------------------------- the rules
def _rule_blocks(text: str) -> dict[str, str]:
    """``{rule name: its text}``; ``use rule A as B with:`` is A's directives, overridden by its own."""
    head = re.compile(r"^(?:rule (\w+):|use rule (\w+) as (\w+)(?: with:)?)[ \t]*$", re.M)
    matches = list(head.finditer(text))
    blocks, derived = {}, {}
    for m, nxt in zip(matches, matches[1:] + [None]):
        body = text[m.end():nxt.start() if nxt else len(text)]
        end = re.search(r"^\S", body, re.M)          # the next unindented line ends the rule
        body = body[:end.start()] if end else body
        if m.group(1):
            blocks[m.group(1)] = body
        else:
            derived[m.group(3)] = (m.group(2), body)
    while derived:
        ready = {new: (base, body) for new, (base, body) in derived.items() if base in blocks}
        assert ready, f"use rule: no base rule for {sorted(derived)}"
        for new, (base, body) in ready.items():
            blocks[new] = _override(blocks[base], body)
            del derived[new]
    return blocks


def _directives(body: str) -> dict[str, str]:
    """``{directive: its text}`` of a rule body (``    shell:`` and the lines indented under it)."""
    out: dict[str, str] = {}
    key = None
    for line in body.splitlines():
        m = re.match(r"    (\w+):(.*)", line)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key and (line.startswith("        ") or not line.strip()):
            out[key] += "\n" + line
    return out


def _override(base: str, body: str) -> str:
    merged = {**_directives(base), **_directives(body)}
    return "".join(f"    {k}:{v}\n" for k, v in merged.items())


def rules() -> dict[str, tuple[Path | None, set[str]]]:
    """``{rule: (its conda env file or None, the chexflow subcommands its shell command runs)}``."""
    files = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    text = "\n".join(p.read_text() for p in files)
    out = {}
    for name, body in _rule_blocks(text).items():
        d = _directives(body)
        if "shell" not in d:
            continue
        shell = d["shell"]
        if "{resources.mpi" in shell:          # the launcher, e.g. mpi="chexflow launch"
            shell += d.get("resources", "")
        commands = set(re.findall(r"\bchexflow\s+([a-z][a-z-]*)", shell))   # also `python -m chexflow X`
        env = re.search(r'"([^"]+\.ya?ml)"', d.get("conda", ""))
        out[name] = ((REPO / "rules" / env.group(1)).resolve() if env else None, commands)
    return out


RULES = rules()
ENVS = sorted({env for env, _ in RULES.values() if env is not None})


def test_rules_are_found():
    assert {"pretrain_model", "finetune_model", "evaluate_model", "render_report", "write_shards"} <= set(RULES)
    # keep-log: each attempt's log kept under a numbered name (issue 18)
    assert RULES["pretrain_model"][1] == {"keep-log", "train", "launch"}
    assert RULES["sweep_trial"][1] == {"keep-log", "sweep-trial", "launch"}
    assert command_imports("train") <= command_imports("sweep-trial")   # a trial runs `chexflow train`


def test_rule_parser_follows_use_rule():
    text = ("rule base:\n    conda:\n        \"../envs/train.yaml\"\n    shell:\n        \"chexflow train --x\"\n\n"
            "use rule base as other with:\n    shell:\n        \"chexflow evaluate\"\n"
            "        \" --y\"\n\nuse rule base as same\n")
    blocks = _rule_blocks(text)
    assert sorted(blocks) == ["base", "other", "same"]
    assert "envs/train.yaml" in _directives(blocks["other"])["conda"]
    assert "chexflow evaluate" in _directives(blocks["other"])["shell"]
    assert "chexflow train" in _directives(blocks["same"])["shell"]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_env_declares_what_its_command_imports(rule):
    env, commands = RULES[rule]
    assert commands, f"rule {rule}: its shell command runs no `chexflow <subcommand>`"
    assert env is not None and env.is_file(), f"rule {rule}: no conda env file ({env})"
    names, _ = conda_env(env)
    needed = set().union(*(third_party(command_imports(c)) for c in commands))
    for module in sorted(needed):
        dist = distribution(module)
        if dist in BUILT_OUTSIDE:
            assert BUILT_OUTSIDE[dist] in env.read_text(), \
                f"rule {rule}: {env.name} must say that `python -m {BUILT_OUTSIDE[dist]}` builds {dist}"
            continue
        assert dist in names, (f"rule {rule} runs `chexflow {' / '.join(sorted(commands))}`, which imports "
                               f"{module!r}: {env.relative_to(REPO)} does not declare {dist!r}")


# --------------------------------------------------------------------------- the whole package
def third_party_imports(folder: Path) -> set[str]:
    """Third-party top-level modules the .py files under ``folder`` import (not its own modules)."""
    files = list(folder.rglob("*.py"))
    modules = set().union(*(_imports_in(ast.parse(p.read_text()))[0] for p in files))
    return third_party(modules) - {p.stem for p in files} - {p.stem for p in (REPO / "bench").glob("*.py")}


@pytest.mark.parametrize("folder", ["workflow/chexflow", "envs/chexflow_install", "tests", "bench"])
def test_imports_are_declared_in_pyproject_and_installed_by_requirements(folder):
    declared = set().union(*pyproject_groups().values())
    req_names, req_pins = requirements_txt()
    for module in sorted(third_party_imports(REPO / folder)):
        dist = distribution(module)
        if dist in BUILT_OUTSIDE:
            assert f"python -m {BUILT_OUTSIDE[dist]}" in SETUP_SH.read_text()
        elif dist in PINNED_OUTSIDE:
            assert dist in req_pins, f"{dist} (imported as {module!r}) must be pinned in {REQUIREMENTS.name}"
        else:
            assert dist in declared, f"pyproject.toml does not declare {dist!r} (imported as {module!r})"
            assert dist in req_names, f"{REQUIREMENTS.name} does not install {dist!r} (imported as {module!r})"


def test_requirements_install_every_group_and_pin_only_declared_packages():
    req_names, req_pins = requirements_txt()
    assert set().union(*pyproject_groups().values()) <= req_names, \
        f"{REQUIREMENTS.name}: `-e .[...]` must name every group of pyproject.toml"
    declared = {canonicalize_name(r.name): r for reqs in pyproject_requirements().values() for r in reqs}
    for name, version in req_pins.items():
        assert name in declared or name in PINNED_OUTSIDE, f"{REQUIREMENTS.name} pins {name}, which nothing declares"
        if name in declared:
            assert declared[name].specifier.contains(version), \
                f"{REQUIREMENTS.name} pins {name}=={version} outside pyproject.toml's {declared[name].specifier}"


@pytest.mark.parametrize("env", ENVS, ids=lambda p: p.name)
def test_conda_env_pins_are_those_of_requirements(env):
    _, req_pins = requirements_txt()
    names, pins = conda_env(env)
    for name, version in pins.items():
        assert req_pins.get(name) == version, \
            f"{env.name} pins {name}=={version}, {REQUIREMENTS.name} {name}=={req_pins.get(name)}"
    for name in PINNED_OUTSIDE & names:
        assert name in pins, f"{env.name}: {name} must carry the pin of {REQUIREMENTS.name}"
