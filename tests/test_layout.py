"""The core stays in parts small enough to hold in mind (issue 43): no class in fttree/core over
600 lines. The tree machine was 1,394 and the membership about 900 before their split."""

from __future__ import annotations

import ast
from pathlib import Path

import fttree.core

CORE = Path(fttree.core.__file__).parent
LARGEST_CLASS_LINES = 600


def class_sizes(source: str) -> dict[str, int]:
    """Each class's name -> its lines, decorators and docstring included."""
    return {n.name: (n.end_lineno or n.lineno) - n.lineno + 1 for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ClassDef)}


def test_no_class_in_core_is_over_600_lines() -> None:
    sizes = {f"{path.name}:{name}": lines for path in sorted(CORE.glob("*.py"))
             for name, lines in class_sizes(path.read_text()).items()}
    assert sizes, "no classes found: is CORE the package's folder?"
    too_big = {name: lines for name, lines in sizes.items() if lines > LARGEST_CLASS_LINES}
    assert not too_big, too_big


def test_the_measure_counts_a_class_to_its_last_line() -> None:
    assert class_sizes("class A:\n    x = 1\n\n    def f(self) -> None:\n        pass\n") == {"A": 5}
