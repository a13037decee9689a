"""voicebot/serving/ schedules models without importing them: no module there imports voicebot.tts
(nor voicebot.asr), at the top, under TYPE_CHECKING or inside a function; the models implement
its interfaces (model_interfaces.DecodePool: voicebot/tts/cosyvoice2/lm_pool.py) and import it."""

from __future__ import annotations

import ast
from pathlib import Path

import voicebot.serving

SERVING = Path(voicebot.serving.__file__).parent
MODELS = ("voicebot.tts", "voicebot.asr")


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    names = []
    for node in ast.walk(tree):  # every import node: module level, if TYPE_CHECKING, def bodies
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return names


def test_serving_imports_no_model():
    found = [f"{path.name}:{line} {name}" for path in sorted(SERVING.glob("*.py"))
             for line, name in imported(ast.parse(path.read_text()))
             if any(name == m or name.startswith(m + ".") for m in MODELS)]
    assert found == []


def test_the_check_sees_every_kind_of_import():
    source = ("import voicebot.tts.x\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
              "    from voicebot.tts import y\ndef f():\n    from voicebot.asr.z import w\n")
    assert {name for _, name in imported(ast.parse(source))} >= {"voicebot.tts.x", "voicebot.tts.y", "voicebot.asr.z"}
