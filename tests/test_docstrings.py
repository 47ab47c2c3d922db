"""Docstrings name only what exists: every ``labkit.x.y`` a docstring of labkit mentions (and every
``:mod:`.x``` of a package's own parts) resolves to a module or an attribute. A moved or renamed
function otherwise leaves its old name behind in the prose (``labkit.repository.restart`` stood in
soak.py's docstring long after it moved to ``labkit.server``)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "labkit"
#: ``labkit.a.b.c`` anywhere in a docstring; ``~`` (Sphinx's short form) is allowed before it.
DOTTED = re.compile(r"(?<![\w.])~?(labkit(?:\.\w+)+)")
#: ``:mod:`.live``` and ``:func:`.x``` in a package's ``__init__``: its own parts.
RELATIVE = re.compile(r":\w+:`~?(\.\w+(?:\.\w+)*)`")


def docstrings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((getattr(node, "lineno", 1), text))
    return found


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` names a module, or an attribute reached from the longest module prefix
    (a trailing method or field of a class counts)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            target = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            missing = exc.name or name  # None when a parent is a module, not a package
            if not (name == missing or name.startswith(missing + ".")):
                raise  # the module exists, and an import inside it is broken
            continue
        for name in parts[cut:]:
            fields = getattr(target, "__dataclass_fields__", {})
            if name in fields:
                return True
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def mentions(path: Path) -> list[tuple[int, str]]:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.removesuffix(".__init__") if path.name == "__init__.py" else module
    package = package if path.name == "__init__.py" else package.rpartition(".")[0]
    out = []
    for line, text in docstrings(path):
        out += [(line, name.rstrip(".")) for name in DOTTED.findall(text)]
        out += [(line, package + rel) for rel in RELATIVE.findall(text)]
    return out


SOURCES = [
    p for p in sorted(PACKAGE.rglob("*.py")) if "templates" not in p.relative_to(PACKAGE).parts
]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_every_labkit_name_in_a_docstring_exists(path):
    missing = [f"line {line}: {name}" for line, name in mentions(path) if not resolves(name)]
    assert not missing, f"{path.name}'s docstrings name what does not exist: {missing}"


def test_the_check_finds_a_stale_name_and_accepts_real_ones():
    assert resolves("labkit.server.recover") and resolves("labkit.server.process.TritonServer.stop")
    assert not resolves("labkit.repository.restart") and not resolves("labkit.models")
