"""The package layering of rimuru/, read from the source with `ast` (nothing is imported).

Layers, lowest first; a package imports packages of lower layers and of its own (no cycles), never of a
higher one:

    0  config, model_spec
    1  memory, kernels, distributed
    2  models
    3  experts
    4  engine
    5  bench, sim, server         (sim imports bench; cli imports server)
    6  cli, demo, testing, rimuru/__init__ (re-exports the engine's LLM API)

Every import statement counts: module level, inside functions (lazy imports) and under `if TYPE_CHECKING:`.
Modules named in strings (cli.py's subcommand table for importlib) are not seen; cli is the top layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rimuru"

LAYERS: list[set[str]] = [
    {"config", "model_spec"},
    {"memory", "kernels", "distributed"},
    {"models"},
    {"experts"},
    {"engine"},
    {"bench", "sim", "server"},
    {"cli", "demo", "testing", "rimuru"},  # "rimuru": rimuru/__init__.py
]
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

# Module imports that break the layering and are being removed. This set must shrink to empty: fix the
# import, then delete its entry (the test fails on an entry that no longer occurs).
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> Iterator[str]:
    """The rimuru modules `path` (module `name`) imports: `from pkg import sub` names the submodule when
    there is one, else the package itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb level - 1 packages above this module's package
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import rimuru.a.b` of a non-module attribute path
                target = target.rpartition(".")[0]
            if target.startswith("rimuru"):
                yield target


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rimuru"


def import_edges() -> set[tuple[str, str]]:
    """(importer, imported) module pairs across package boundaries."""
    modules = all_modules()
    return {(name, target) for name, path in modules.items() for target in imported_modules(path, name, modules)
            if package_of(target) != package_of(name)}


def is_violation(importer: str, imported: str) -> bool:
    return LAYER_OF[package_of(imported)] > LAYER_OF[package_of(importer)]


def test_every_package_has_a_layer() -> None:
    packages = {package_of(m) for m in all_modules()}
    assert packages == set(LAYER_OF), f"unlisted: {sorted(packages - set(LAYER_OF))}, " \
                                      f"gone: {sorted(set(LAYER_OF) - packages)}"


def test_no_package_imports_a_higher_layer() -> None:
    violations = {e for e in import_edges() if is_violation(*e)}
    new = sorted(violations - KNOWN_VIOLATIONS)
    assert not new, "imports against the layering:\n" + "\n".join(f"  {a} -> {b}" for a, b in new)
    stale = sorted(KNOWN_VIOLATIONS - violations)
    assert not stale, "KNOWN_VIOLATIONS entries that no longer occur (delete them):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in stale)


def test_no_import_cycles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for a, b in import_edges() - KNOWN_VIOLATIONS:
        graph.setdefault(package_of(a), set()).add(package_of(b))
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(pkg: str, path: list[str]) -> None:
        state[pkg] = 1
        for nxt in sorted(graph.get(pkg, ())):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [pkg, nxt]
                raise AssertionError("import cycle between packages: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[pkg] = 2

    for pkg in sorted(graph):
        if pkg not in state:
            visit(pkg, [pkg])
