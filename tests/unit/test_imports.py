"""No import circle anywhere in voicebot/, between modules or between folders: the package reads
top-down, stage after stage, and each folder can be read (or moved) knowing only those below it.

Every import counts, also those inside functions or under TYPE_CHECKING and those of package
__init__ files: a circle hidden by a lazy import is still two modules that cannot be read (or moved)
one without the other.

A folder is a first-level package of voicebot/ (voicebot/tts, with voicebot/tts/cosyvoice2 in it);
each module at the root (voicebot/runtime.py) is a folder of its own here.
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


def folder_of(module: str) -> str:
    """voicebot.tts.cosyvoice2.lm -> voicebot.tts; voicebot.config -> voicebot.config."""
    return ".".join(module.split(".")[:2])


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the other folders its modules import (module graph of `import_graph`)."""
    folders: dict[str, set[str]] = {folder_of(m): set() for m in graph}
    for module, targets in graph.items():
        here = folder_of(module)
        folders[here] |= {folder_of(t) for t in targets} - {here}
    return folders


def test_voicebot_has_no_import_circle():
    graph = import_graph(ROOT / "voicebot")
    assert sum(map(len, graph.values())) > 50  # the walk really saw the imports
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join([*circle, circle[0]])


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of nodes that reach each other (the strongly connected components of more than
    one node): every circle lies inside one. Sorted."""
    reach: dict[str, set[str]] = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        reach[start] = seen
    groups = {tuple(sorted(b for b in graph if b in reach[a] and a in reach[b])) for a in graph}
    return sorted(list(group) for group in groups if len(group) > 1)


def test_voicebot_has_no_folder_import_circle():
    graph = import_graph(ROOT / "voicebot")
    folders = folder_graph(graph)
    assert {"voicebot.asr", "voicebot.session", "voicebot.config"} <= folders.keys()  # the folders really were seen
    found = []
    for group in tangles(folders):
        imports = [f"{m} -> {t}" for m in sorted(graph) for t in sorted(graph[m])
                   if folder_of(m) in group and folder_of(t) in group and folder_of(m) != folder_of(t)]
        found.append(f"folders {', '.join(group)} import each other:\n    " + "\n    ".join(imports))
    assert not found, "\n".join(found)


def test_a_folder_circle_is_found_through_an_init_and_a_type_checking_import(tmp_path):
    package = tmp_path / "pkg"
    for folder in ("a", "b", "b/deep"):
        (package / folder).mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "top.py").write_text("from pkg.a import x\n")  # a root module is a folder of its own
    (package / "a" / "__init__.py").write_text("from pkg.b.deep.m import y\n")
    (package / "b" / "__init__.py").write_text("")
    (package / "b" / "deep" / "__init__.py").write_text("")
    (package / "b" / "deep" / "m.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    folders = folder_graph(import_graph(package))
    assert folders == {"pkg": set(), "pkg.top": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert tangles(folders) == [["pkg.a", "pkg.b"]]
    (package / "b" / "deep" / "m.py").write_text("from pkg.b import deep\n")  # inside its own folder: no edge
    assert tangles(folder_graph(import_graph(package))) == []


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
