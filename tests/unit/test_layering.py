"""Layering rules of docs/architecture.md, checked on the source: pure packages import no
protobuf or gRPC, the simulator does not import the benchmarks built on it, and no
package has an import cycle between its modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBS, SERVICES = ROOT / "libs", ROOT / "services"

RULES = [
    # (package directory, module prefixes it must not import)
    ("libs/inferx/scheduling", ("inferx.v1", "grpc", "inferx.bench", "inferx.sim")),
    ("libs/inferx/chain", ("inferx.v1", "grpc", "inferx.bench", "inferx.sim", "inferx.scheduling")),
    ("libs/inferx/sim", ("inferx.v1", "grpc", "inferx.bench")),
    # The OpenAI front's pure parts: the HTTP server is the router's (inferx_router.http_front).
    ("libs/inferx/openai_compat", ("inferx.v1", "grpc", "starlette", "fastapi", "uvicorn", "httpx")),
]


def imports_of(path: Path) -> list[str]:
    """Every module `path` imports, TYPE_CHECKING blocks included (a cycle hidden behind
    TYPE_CHECKING is still a cycle in the design)."""
    package = ".".join(path.relative_to(LIBS if LIBS in path.parents else SERVICES).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names]
    return found


@pytest.mark.parametrize(("directory", "forbidden"), RULES)
def test_pure_packages_import_no_io_or_higher_layers(directory: str, forbidden: tuple[str, ...]) -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / directory).rglob("*.py"))
        for name in imports_of(path)
        if any(name == prefix or name.startswith(prefix + ".") for prefix in forbidden)
    ]
    assert offenders == []


def module_name(path: Path) -> str:
    base = LIBS if LIBS in path.parents else SERVICES
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize(
    "package",
    [
        "inferx_router",
        "inferx_scheduler",
        "inferx_memory_pool",
        "inferx_cache",
        "inferx_worker",
        "inferx.scheduling",
    ],
)
def test_no_import_cycles_inside_a_package(package: str) -> None:
    directory = (SERVICES if package.startswith("inferx_") else LIBS).joinpath(*package.split("."))
    modules = {module_name(p): p for p in directory.rglob("*.py")}
    graph = {
        name: {dep for imported in imports_of(path) for dep in modules if imported == dep and dep != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_test_module_names_are_unique_across_the_suite() -> None:
    """pytest imports test modules by basename (rootdir-relative without packages): two
    `test_x.py` in different folders break collection of the whole suite."""
    root = Path(__file__).resolve().parents[1]
    names = [path.name for path in root.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
