"""What bench/gpu_check.sh imports on the GPU box is there: the box's image (its package list,
bench/gpu_image_packages.txt) plus the wheels scripts/fetch_gpu_wheels carries (bench/gpu_wheels.txt).

The walk: every Python step gpu_check.sh runs, its module-level imports (what runs at import time:
module bodies, class bodies, if/try blocks; not function bodies), followed through this repository's
modules (bench/, voicebot/, tests/, and the folders the scripts put on sys.path). Each outside module
is mapped to its distribution (importlib.metadata, in this environment where everything is
installed), and the requirements of each one the image lacks are followed for CPython 3.12 on Linux. A
function-level import of an outside module counts too, unless LAZY_OFF_THE_GPU_PATH says why the
GPU run never calls it.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

from voicebot.config.base import REPO_ROOT

ENTRY_POINTS = ["bench/gpu_correctness.py", "bench/serve.py", "bench/cosyvoice2.py", "bench/gpu_proxy.py"]
# Folders the entry points put on sys.path besides the repository root: their own (python3 bench/x.py)
# and the ones they insert (tiny_frontend, golden_bounds).
SCRIPT_PATHS = ["bench", "tests/cosyvoice2"]
LOCAL_PACKAGES = {"bench", "voicebot", "tests"}
# Function-level imports the GPU run never reaches, and why.
LAZY_OFF_THE_GPU_PATH = {
    "websockets": "bench/serve.py's --server clients (gpu_check.sh runs no --server)",
    "uvicorn": "tests/conftest.py's running_server (bench/serve.py --server only)",
    "flash_attn": "optional: attention_backend falls back to SDPA when it does not import",
    "modelscope": "voicebot/models.py's model download: the benches build random weights, download nothing",
    "silero_vad": "voicebot/audio/endpoint.py's Silero VAD: no bench step runs a VAD",
}
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> set[str]:
    """Package names of a list file: one a line, `name` or `name==version`, # comments."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalized(re.split(r"[=<>!~ ]", line, 1)[0]))
    return names


def module_file(name: str) -> Path | None:
    """This repository's file for a dotted module name, or None when it is not one of ours."""
    parts = name.split(".")
    roots = [REPO_ROOT] if parts[0] in LOCAL_PACKAGES else [REPO_ROOT / p for p in SCRIPT_PATHS]
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def imports(path: Path) -> tuple[list[str], list[str]]:
    """(module-level, function-level) absolute module names `path` imports (for `from a import b`:
    a, and a.b in case b is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    ours = path.is_relative_to(REPO_ROOT)
    package = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts[:-1]) if ours else ""
    eager: list[str] = []
    lazy: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            out = lazy if in_function else eager
            if isinstance(child, ast.Import):
                out += [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1] if package else []
                    base = ".".join([*anchor, *([base] if base else [])])
                out.append(base)
                out += [f"{base}.{alias.name}" for alias in child.names]
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return eager, lazy


def outside_modules(files: list[Path]) -> tuple[dict[str, str], dict[str, str]]:
    """Outside top-level modules that `files` and the repository modules they import import, at
    import time and in functions: module -> the first file seen importing it."""
    eager_out: dict[str, str] = {}
    lazy_out: dict[str, str] = {}
    files = list(files)
    seen: set[Path] = set()
    while files:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        eager, lazy = imports(path)
        where = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else path.name
        for names, out in ((eager, eager_out), (lazy, lazy_out)):
            for name in names:
                parts = name.split(".")
                local = [module_file(".".join(parts[: i + 1])) for i in range(len(parts))]  # packages' __init__ too
                if any(local):
                    if out is eager_out:
                        files += [f for f in local if f is not None]
                    continue
                top = parts[0]
                if top and top not in sys.stdlib_module_names and top != "__future__" and module_file(top) is None:
                    out.setdefault(top, where)
    return eager_out, lazy_out


def distributions(modules: dict[str, str], image: set[str]) -> dict[str, str]:
    """Distribution -> why, for the modules and, recursively, the requirements on the GPU box of
    those the image lacks (the image's own come with theirs, in the image's versions)."""
    owners = md.packages_distributions()
    needed: dict[str, str] = {}
    queue: list[tuple[str, str]] = []
    for module, where in modules.items():
        assert module in owners, f"{module} (imported by {where}) belongs to no installed distribution"
        queue += [(dist, f"{module} imported by {where}") for dist in owners[module]]
    while queue:
        dist, why = queue.pop()
        if normalized(dist) in needed:
            continue
        needed[normalized(dist)] = why
        if normalized(dist) in image:
            continue
        for spec in md.requires(dist) or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate(TARGET):
                queue.append((requirement.name, f"required by {dist}"))
    return needed


def gpu_run_needs(image: set[str]) -> dict[str, str]:
    """Distribution -> why, for everything bench/gpu_check.sh's Python steps import on the box."""
    eager, lazy = outside_modules([REPO_ROOT / e for e in ENTRY_POINTS if (REPO_ROOT / e).is_file()])
    assert {"torch", "numpy", "soundfile"} <= eager.keys()  # the walk reached the benches' imports
    unexplained = {m: w for m, w in lazy.items() if m not in eager and m not in LAZY_OFF_THE_GPU_PATH}
    return distributions(eager | unexplained, image)


IMAGE = listed(REPO_ROOT / "bench" / "gpu_image_packages.txt")
WHEELS = listed(REPO_ROOT / "bench" / "gpu_wheels.txt")


def test_the_gpu_runs_imports_are_in_the_image_or_the_carried_wheels():
    needed = gpu_run_needs(IMAGE)
    missing = {dist: why for dist, why in needed.items() if dist not in IMAGE | WHEELS}
    assert not missing, f"not in the GPU image nor in bench/gpu_wheels.txt: {missing}"
    # Nothing carried that the run does not need, nor what the image already has.
    assert WHEELS <= needed.keys() and not WHEELS & IMAGE, (sorted(WHEELS - needed.keys()), sorted(WHEELS & IMAGE))


def test_a_wheel_left_out_is_named_with_who_needs_it():
    needed = gpu_run_needs(IMAGE)
    carried = WHEELS - {"soxr", "cffi"}
    missing = {dist: why for dist, why in needed.items() if dist not in IMAGE | carried}
    assert missing.keys() == {"soxr", "cffi"}, missing
    assert missing["soxr"].startswith("soxr imported by voicebot/") and missing["cffi"].startswith("required by ")


def test_the_walk_follows_our_modules_and_tells_eager_from_lazy(tmp_path):
    """An entry point importing yaml and one of our modules (which imports soxr) at import time,
    websockets in a function: soxr, which the image lacks, is found through our module."""
    entry = tmp_path / "probe.py"
    entry.write_text("import yaml\nfrom voicebot.audio import resample\n\ndef later():\n    import websockets\n")
    eager, lazy = outside_modules([entry])
    assert {"yaml", "soxr", "numpy"} <= eager.keys() and eager["yaml"] == "probe.py" and "websockets" in lazy
    needed = distributions(eager, IMAGE)
    assert "pyyaml" in IMAGE and "soxr" not in IMAGE and "soxr" in needed
