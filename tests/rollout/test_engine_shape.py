"""The rollout and the runtime stay readable in pieces: no file of rollout/ or runtime/ over 400
lines, no function of the engine (rollout/) over 60, no class of either package inheriting from
another class of the package (the engine's parts hold the pass's context instead), each class
with a docstring."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "metax_operator"
FILES = sorted([*(PACKAGE / "rollout").glob("*.py"), *(PACKAGE / "runtime").glob("*.py")])
MAX_FILE_LINES = 400


def functions(tree: ast.Module) -> dict[str, int]:
    """Lines of each function and method of a module."""
    return {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def package_classes() -> set[str]:
    """The names of every class the package defines."""
    return {
        n.name for path in PACKAGE.rglob("*.py") for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
    }


def inheriting(tree: ast.Module, own: set[str]) -> list[str]:
    """`Class(Base)` for each class of `tree` whose base is a class of `own`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if name in own:
                    found.append(f"{node.name}({name})")
    return found


def test_no_file_of_rollout_or_runtime_over_400_lines():
    assert FILES, "the packages are where the test looks"
    long = {str(p.relative_to(PACKAGE)): n for p in FILES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_of_the_engine_over_60_lines():
    engine = [p for p in FILES if p.parent.name == "rollout"]
    long = {f"{p.name}:{n}": lines for p in engine for n, lines in functions(ast.parse(p.read_text())).items() if lines > 60}
    assert long == {}


def test_no_class_inherits_from_another_class_of_the_package():
    own = package_classes()
    found = {p.name: names for p in FILES if (names := inheriting(ast.parse(p.read_text()), own))}
    assert found == {}


def test_every_class_has_a_docstring():
    missing = [
        f"{p.name}:{n.name}"
        for p in FILES
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.ClassDef) and ast.get_docstring(n) is None
    ]
    assert missing == []


def test_the_measures_can_fail():
    """The checks above see what they look for: a 3-line function, a class deriving from one of
    the package's, a class without a docstring."""
    tree = ast.parse('class A:\n    """a"""\n\nclass B(A):\n    def f(self):\n        x = 1\n        return x\n')
    assert functions(tree) == {"f": 3}
    assert inheriting(tree, {"A"}) == ["B(A)"] and inheriting(tree, {"Other"}) == []
    assert [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and ast.get_docstring(n) is None] == ["B"]
