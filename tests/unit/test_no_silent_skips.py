"""No test skips because a dependency is missing. `make test` installs every dependency
the tests use (vLLM or its CPU build included), so a missing or moved module is a broken
environment, which must fail loudly, not turn a test into a silent skip (issue #45)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def importorskip_calls(path: Path) -> list[int]:
    """The lines of `path` that call pytest.importorskip (or a bare importorskip)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "importorskip":
                lines.append(node.lineno)
    return lines


def test_no_test_skips_on_a_missing_module() -> None:
    found = [
        f"{path.relative_to(TESTS.parent)}:{line}"
        for path in sorted(TESTS.rglob("*.py"))
        for line in importorskip_calls(path)
    ]
    assert not found, "use a plain import (a missing module must fail, not skip): " + ", ".join(found)
