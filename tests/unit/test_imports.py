"""No import circle anywhere in voicebot/: the package reads top-down, stage after stage.

Every import counts, also those inside functions or under TYPE_CHECKING: a circle hidden by a lazy
import is still two modules that cannot be read (or moved) one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports."""
    root = package.parent

    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    paths = {name_of(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    anchor = here[: len(here) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, only mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            # A module's own parent packages are initialised before it, never through it: no edge.
            graph[name] |= {t for t in targets if t in paths and t != name and not name.startswith(t + ".")}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in import order), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module) :]
        if module in done:
            return None
        path.append(module)
        for target in sorted(graph[module]):
            if (circle := visit(target)) is not None:
                return circle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if (circle := visit(module)) is not None:
            return circle
    return None


def test_voicebot_has_no_import_circle():
    graph = import_graph(ROOT / "voicebot")
    assert sum(map(len, graph.values())) > 50  # the walk really saw the imports
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join([*circle, circle[0]])


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import f\n")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    assert sorted(find_circle(import_graph(package))) == ["pkg.a", "pkg.sub.b"]
    (package / "sub" / "b.py").write_text("def f():\n    import pkg\n")
    assert find_circle(import_graph(package)) is None
