"""The documentation stays true: the README starts with the two commands (the second is what CI runs),
every link between README.md, BENCHMARKS.md and docs/ resolves and every document is in the tables of
contents, no user-facing text carries issue numbers or session history, BENCHMARKS.md opens with one
table whose every figure has a command and a date, docs/layout.md's table of facts names modules that
exist and define the names it gives, with the layers tests/test_layers.py enforces, CITATION.cff and
LICENSE agree with pyproject.toml, and docs/img/screenshot.py takes the README's picture."""
from __future__ import annotations

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PACKAGE = REPO / "workflow" / "chexflow"
DOCS = REPO / "docs"
USER_DOCS = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted(DOCS.glob("*.md"))]
LOGS = {REPO / "BENCHMARKS.md", DOCS / "benchmarks-log.md"}   # dated by design
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def layout() -> str:
    return (DOCS / "layout.md").read_text()


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
        assert path.is_file(), f"docs/layout.md, {fact!r}: {module} does not exist"
        missing = set(names) - defined(path)
        assert not missing, f"docs/layout.md, {fact!r}: {module} defines no {sorted(missing)}"


def test_the_layers_described_are_the_ones_enforced():
    from test_layers import LAYERS
    text = layout()
    order = re.search(r"bottom up: (.+?)\. A module", text, re.S).group(1)
    described = [[m.strip("`") for m in step.split("/")] for step in re.findall(r"`[^`]+`(?:/`[^`]+`)?", order)]
    layers = [LAYERS[name] for step in described for name in step]
    assert layers == sorted(layers)
    assert {name for step in described for name in step} == set(LAYERS) - {"__init__", "__main__", "install"}


# --------------------------------------------------------------------------- the README and the docs
def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    text = (REPO / "README.md").read_text()
    assert re.findall(r"^## (.+)$", text, re.M)[0] == "Two commands"
    block = text.split("## Two commands\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert commands == ["bash envs/setup.sh && .venv/bin/snakemake --profile profiles/default",
                        "bash envs/setup.sh --test && .venv/bin/python -m pytest"]
    # CI runs command 2, its parts in order, with the machine's speed figure between set-up and tests
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd ", "trap "))]
    setup, tests = commands[1].split(" && ")
    assert ci == [f"{setup} && .venv/bin/python bench/machine_speed.py && {tests}"]
    picture = re.search(r"!\[[^\]]+\]\((docs/img/[^)]+\.png)\)", text).group(1)
    assert (REPO / picture).is_file()


def test_every_link_between_the_documents_resolves():
    checked = 0
    for doc in USER_DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.exists(), f"{doc.relative_to(REPO)}: link to {target} ({path} does not exist)"
            checked += 1
    assert checked > 40


def test_every_document_is_in_the_tables_of_contents():
    docs = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    linked = lambda path: {Path(t.split("#", 1)[0]).name for t in LINK.findall(path.read_text())}  # noqa: E731
    assert docs - linked(DOCS / "README.md") == set()
    assert docs - {"benchmarks-log.md"} - linked(REPO / "README.md") == set()
    assert "benchmarks-log.md" in linked(REPO / "BENCHMARKS.md")


def test_user_facing_text_carries_no_issue_numbers_or_session_history():
    history = re.compile(r"\bissues?\s*#?\d|\b(this|previous|earlier|last) session\b|\bwork packages?\b|"
                         r"\bthe lead\b|\bbranch wt\d", re.I)
    for doc in USER_DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            assert not history.search(line), f"{doc.relative_to(REPO)}:{n}: {line}"
            if doc not in LOGS:
                assert not re.search(r"\b20\d\d-\d\d-\d\d\b", line), f"{doc.relative_to(REPO)}:{n}: a date: {line}"


def test_benchmarks_open_with_one_table_of_figures_each_with_its_command_and_date():
    text = (REPO / "BENCHMARKS.md").read_text()
    assert text.count("\n## ") == 0, "the dated entries live in docs/benchmarks-log.md"
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[0] == "| what | figure | command | date |"
    for row in rows[1:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 4 and cells[1] and "`" in cells[2], row
        assert re.fullmatch(r"20\d\d-\d\d-\d\d|—", cells[3]), row
    assert len(rows) > 15


# --------------------------------------------------------------------------- license and citation
def test_citation_and_license_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    cff = yaml.safe_load((REPO / "CITATION.cff").read_text())
    assert {"cff-version", "message", "title", "authors"} <= set(cff)       # CFF 1.2.0's required keys
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert (cff["title"], cff["version"], cff["license"]) == (project["name"], project["version"],
                                                              project["license"]["text"])
    assert cff["authors"] == [{"name": "chexflow contributors"}]
    license_text = (REPO / "LICENSE").read_text()
    assert license_text.startswith(f"{project['license']['text']} License\n")
    assert re.search(r"^Copyright \(c\) 20\d\d chexflow contributors$", license_text, re.M)


# --------------------------------------------------------------------------- the README's picture
def _screenshot_module():
    spec = importlib.util.spec_from_file_location("docs_screenshot", DOCS / "img" / "screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_picture_is_the_scripts_size():
    from PIL import Image
    shot = _screenshot_module()
    with Image.open(DOCS / "img" / "report.png") as im:
        assert im.format == "PNG" and im.size == (shot.WIDTH, shot.HEIGHT)
        assert len(im.convert("RGB").getcolors(maxcolors=1 << 16)) > 50     # a rendered page, not a blank


def test_screenshot_refuses_a_missing_report(tmp_path):
    shot = _screenshot_module()
    assert shot.main([str(tmp_path / "none.html"), str(tmp_path / "x.png")]) == 1
    with pytest.raises(shot.ScreenshotError, match="none.html: no such report"):
        shot.screenshot(tmp_path / "none.html", tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_screenshot_renders_the_page_at_the_asked_size(tmp_path):
    """Headless Chromium renders a page of two known colour bands: the picture is width x height and
    each band is where the page put it."""
    from PIL import Image
    shot = _screenshot_module()
    if not Path(shot.CHROMIUM).exists():
        pytest.skip(f"{shot.CHROMIUM} not installed (bash envs/setup.sh --test)")
    page = tmp_path / "page.html"
    page.write_text('<!doctype html><html><body style="margin:0"><div style="height:300px;background:#c80000"></div>'
                    '<div style="height:300px;background:#0000c8"></div></body></html>')
    out = shot.screenshot(page, tmp_path / "img" / "page.png", width=400, height=500)
    assert out == tmp_path / "img" / "page.png" and sorted(p.name for p in out.parent.iterdir()) == ["page.png"]
    with Image.open(out) as im:
        rgb = im.convert("RGB")
        assert im.size == (400, 500)
        assert rgb.getpixel((200, 150)) == (200, 0, 0) and rgb.getpixel((200, 450)) == (0, 0, 200)
        assert rgb.getpixel((200, 299)) == (200, 0, 0) and rgb.getpixel((200, 300)) == (0, 0, 200)
