"""Read the official cosyvoice2.yaml (HyperPyYAML) into plain nested dicts.

Nothing named in the file is imported or called. The tags become:
  !new:pkg.Cls {k: v}    -> {"__class__": "pkg.Cls", "k": v}      (a sequence gives "__args__": [...])
  !name:pkg.fn {k: v}    -> {"__function__": "pkg.fn", "k": v}
  !apply:pkg.fn [args]   -> {"__apply__": "pkg.fn", "__args__": [...]}   (never executed)
  !ref <key>             -> the value of the top-level key (the same object, as HyperPyYAML does)
  !ref <a> * <b>         -> simple arithmetic on referenced numbers; other text is interpolated
  !copy <key>            -> a deep copy of the referenced value
"""

from __future__ import annotations

import ast
import copy
import operator
import re
from pathlib import Path
from typing import Any

import yaml

QWEN_DIR_NAME = "CosyVoice-BlankEN"


class _Ref:
    def __init__(self, expr: str, deep_copy: bool = False) -> None:
        self.expr, self.deep_copy = expr, deep_copy


class _Loader(yaml.SafeLoader):
    pass


# HyperPyYAML parses YAML 1.2 (ruamel), where "1e-06" is a float; PyYAML's 1.1 rule wants a dot.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _node_value(loader: _Loader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node) or None


def _tagged(marker: str):
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> dict:
        value = _node_value(loader, node)
        out: dict[str, Any] = {marker: suffix}
        if isinstance(value, dict):
            out.update(value)
        elif isinstance(value, list):
            out["__args__"] = value
        elif value is not None:
            out["__args__"] = [value]
        return out

    return construct


_Loader.add_multi_constructor("!new:", _tagged("__class__"))
_Loader.add_multi_constructor("!name:", _tagged("__function__"))
_Loader.add_multi_constructor("!apply:", _tagged("__apply__"))
_Loader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))
_Loader.add_constructor("!copy", lambda loader, node: _Ref(loader.construct_scalar(node), deep_copy=True))

_REF = re.compile(r"<([^<>]+)>")
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNOPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _arith(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_arith(node.left), _arith(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_arith(node.operand))
    raise ValueError("not arithmetic")


class _Resolver:
    def __init__(self, root: dict) -> None:
        self.root = root
        self.active: set[str] = set()

    def lookup(self, key: str) -> Any:
        if key not in self.root:
            raise KeyError(f"cosyvoice2.yaml: !ref <{key}> names no top-level key")
        if key in self.active:
            raise ValueError(f"cosyvoice2.yaml: circular !ref through <{key}>")
        self.active.add(key)
        self.root[key] = self.resolve(self.root[key])
        self.active.discard(key)
        return self.root[key]

    def resolve(self, value: Any) -> Any:
        if isinstance(value, dict):
            for k in value:
                value[k] = self.resolve(value[k])
            return value
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, _Ref):
            return value
        expr = value.expr.strip()
        whole = _REF.fullmatch(expr)
        if whole:
            target = self.lookup(whole.group(1))
            return copy.deepcopy(target) if value.deep_copy else target
        text = _REF.sub(lambda m: str(self.lookup(m.group(1))), expr)
        try:
            return _arith(ast.parse(text, mode="eval"))
        except (SyntaxError, ValueError):
            return text  # string interpolation, e.g. "<dir>/file"


def load_hparams(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse <model_dir>/cosyvoice2.yaml. qwen_pretrain_path defaults to <model_dir>/CosyVoice-BlankEN,
    as the official CosyVoice2 class overrides it; `overrides` replaces top-level keys before !ref."""
    model_dir = Path(model_dir)
    with open(model_dir / "cosyvoice2.yaml", encoding="utf-8") as f:
        raw = yaml.load(f, Loader=_Loader)
    raw.update({"qwen_pretrain_path": str(model_dir / QWEN_DIR_NAME), **(overrides or {})})
    resolver = _Resolver(raw)
    for key in list(raw):
        resolver.lookup(key)
    return raw
