"""The package's layout holds: the import contracts of pyproject.toml, the size of its units,
and the README's layout table."""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupy_paged"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80
# A function longer than MAX_FUNCTION_LINES says why it must be one piece in a comment that
# starts with this, on the line after its docstring (or its signature).
ONE_PIECE = "# One piece:"


def test_import_contracts_hold():
    """serving imports neither the API nor the kernels; the reference imports no kernel glue;
    nothing below the runtime imports it (pyproject.toml's [tool.importlinter])."""
    importlinter_cli = pytest.importorskip("importlinter.cli")
    assert importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def test_import_contracts_can_fail(tmp_path, monkeypatch):
    """The contracts see a crossing: a copy of the package whose serving layer imports the kernels fails them."""
    importlinter_cli = pytest.importorskip("importlinter.cli")
    import shutil
    import sys

    shutil.copytree(PACKAGE, tmp_path / "cupy_paged", ignore=shutil.ignore_patterns("__pycache__"))
    scheduler = tmp_path / "cupy_paged" / "serving" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom ..kernels import decode  # noqa\n")
    monkeypatch.chdir(tmp_path)  # import-linter also looks in the working folder: make it the copy's
    sys.path.insert(0, str(tmp_path))
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "cupy_paged"}
    try:
        for name in saved:
            del sys.modules[name]
        assert importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 1
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "cupy_paged"]:
            del sys.modules[name]
        sys.modules.update(saved)


def _code_lines(node: ast.AST) -> int:
    """Lines of a function, its docstring not counted."""
    lines = node.end_lineno - node.lineno + 1
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        lines -= body[0].end_lineno - body[0].lineno + 1
    return lines


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_units_are_short(path):
    text = path.read_text()
    assert len(text.splitlines()) <= MAX_FILE_LINES, f"{path.name} has {len(text.splitlines())} lines"
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > MAX_FUNCTION_LINES:
            first = node.body[1] if len(node.body) > 1 and _code_lines(node) != node.end_lineno - node.lineno + 1 \
                else node.body[0]
            said = any(line.strip().startswith(ONE_PIECE) for line in lines[node.lineno - 1:first.lineno])
            assert said, f"{node.name} ({path.name}:{node.lineno}) has {_code_lines(node)} lines of code"


def test_readme_layout_table_matches_the_tree():
    """Every package folder and module named in the README's layout table exists, and every
    folder of the package is named there."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| `([\w/.]+)` \|", table, re.MULTILINE))
    for name in named:
        assert (ROOT / name).exists(), f"README names {name}, which is not in the tree"
    folders = {str(p.relative_to(ROOT)) + "/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    folders |= {"cupy_paged/", "cuda_src/"}
    assert folders <= named, f"README's layout table lacks {sorted(folders - named)}"
