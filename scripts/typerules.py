"""The type rules of agent/ (scripts/check-imports.py runs them): seams typed end to end
(seam-any) and our own types read by their attributes, not asked for them (duck)."""

from __future__ import annotations

import ast
import builtins
import re
from dataclasses import dataclass
from typing import Iterator, Optional

from sourcetree import PACKAGE, Finding, Tree, dotted, imports


@dataclass(frozen=True)
class Scope:
    """What a module's names are bound to, as far as rule 5 asks."""
    foreign: set[str]            # modules of other libraries (``import os``)
    ours: set[str]               # modules of agent/
    names: dict[str, str]        # from-imported name -> the module it came from


_BUILTINS = set(dir(builtins)) - {"object"}
_OPAQUE = {"Any", "typing.Any", "object"}    # say nothing of the type: no exemption


def _unwrap(ann: Optional[ast.expr]) -> list[ast.expr]:
    """The types an annotation allows: ``Optional[X]``, ``X | None`` and ``"X"`` unwrapped."""
    if ann is None:
        return []
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        try:
            return _unwrap(ast.parse(ann.value, mode="eval").body)
        except SyntaxError:
            return []
    if isinstance(ann, ast.Constant) and ann.value is None:
        return []
    if isinstance(ann, ast.BinOp) and isinstance(ann.op, ast.BitOr):
        return _unwrap(ann.left) + _unwrap(ann.right)
    if isinstance(ann, ast.Subscript) and dotted(ann.value) in ("Optional", "typing.Optional", "Union", "typing.Union"):
        inner = ann.slice
        return [t for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]) for t in _unwrap(e)]
    if isinstance(ann, ast.Subscript):
        return _unwrap(ann.value)
    return [ann]


def _foreign_type(ann: Optional[ast.expr], scope: Scope, local: set[str]) -> bool:
    """Whether an annotation names only types of other libraries (argparse.Namespace,
    BaseException), so that a getattr on the value asks about their attributes."""
    types = _unwrap(ann)
    if not types:
        return False
    for t in types:
        name = dotted(t)
        if name is None or name in _OPAQUE:
            return False
        head = name.split(".")[0]
        if head in scope.foreign:
            continue
        if head in scope.names:
            if scope.names[head].split(".")[0] == PACKAGE:
                return False
            continue
        if head in local or head in scope.ours or head not in _BUILTINS:
            return False
    return True


def duck(tree: Tree, module: str, scope: Scope) -> list[Finding]:
    """Rule 5 for one module."""
    syntax, shown = tree.syntax[module], tree.shown(module)
    local = {n.name for n in ast.walk(syntax) if isinstance(n, ast.ClassDef)}
    out: list[Finding] = []

    def visit(node: ast.AST, fn: Optional[ast.AST], loops: dict[str, list[str]]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            fn = node
        elif isinstance(node, (ast.For, ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for g in [node] if isinstance(node, ast.For) else node.generators:
                consts = _str_constants(g.iter)
                if consts and isinstance(g.target, ast.Name):
                    loops = {**loops, g.target.id: consts}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            arg = node.args[1]
            lits = [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else \
                loops.get(arg.id, []) if isinstance(arg, ast.Name) else []
            ours = [lit for lit in lits if not lit.startswith("__") and lit in tree.attributes]
            if ours and not exempt(node.args[0], fn):
                what = ", ".join(ours)
                out.append(Finding(shown, node.lineno, "duck",
                                   f"{node.func.id}({ast.unparse(node.args[0])}, {ast.unparse(arg)}): {what} "
                                   "defined by a class of agent/; name the type (a Protocol if several fit) and "
                                   "use the attribute", key=",".join(ours)))
        for child in ast.iter_child_nodes(node):
            visit(child, fn, loops)

    def exempt(recv: ast.expr, fn: Optional[ast.AST]) -> bool:
        if not isinstance(recv, ast.Name):
            return False
        if recv.id in scope.foreign:
            return True                       # getattr(os, "O_CLOEXEC", 0)
        where = fn if fn is not None else syntax
        for n in ast.walk(where):
            if isinstance(n, ast.ExceptHandler) and n.name == recv.id:
                return True
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = fn.args
            for p in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if p.arg == recv.id:
                    return _foreign_type(p.annotation, scope, local)
        return False

    visit(syntax, None, {})
    return out


def _str_constants(node: ast.expr) -> list[str]:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts and \
            all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
        return [e.value for e in node.elts]    # type: ignore[attr-defined]
    return []


_ANY_MARK = re.compile(r"#\s*any:\s*\S")


def _any_lines(ann: Optional[ast.expr]) -> list[int]:
    """The lines of an annotation where it says ``Any`` (quoted annotations too)."""
    if ann is None:
        return []
    out = []
    for n in ast.walk(ann):
        if (isinstance(n, ast.Name) and n.id == "Any") or \
                (isinstance(n, ast.Attribute) and n.attr == "Any" and dotted(n.value) == "typing"):
            out.append(n.lineno)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                inner = ast.parse(n.value, mode="eval").body
            except SyntaxError:
                continue
            out += [n.lineno for _ in _any_lines(inner)]
    return out


def _is_protocol(cls: ast.ClassDef) -> bool:
    return any(dotted(b.value if isinstance(b, ast.Subscript) else b) in ("Protocol", "typing.Protocol")
               for b in cls.bases)


def _annotations(cls: ast.ClassDef) -> Iterator[tuple[str, ast.expr]]:
    """(what, annotation) of a Protocol's members; ``*args``/``**kwargs`` left out."""
    for b in cls.body:
        if isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
            yield b.target.id, b.annotation
        elif isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = b.args
            for p in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                if p.annotation is not None:
                    yield f"{b.name} (parameter {p.arg})", p.annotation
            if b.returns is not None:
                yield f"{b.name} (return)", b.returns


def _callable_aliases(syntax: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``Name = Callable[...]`` (or ``Name: TypeAlias = ...``) -> its value."""
    out = {}
    for st in syntax.body:
        target, value = None, None
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            target, value = st.targets[0].id, st.value
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None:
            target, value = st.target.id, st.value
        if target and value is not None and any(dotted(n) in ("Callable", "typing.Callable", "collections.abc.Callable")
                                                for n in ast.walk(value) if isinstance(n, (ast.Name, ast.Attribute))):
            out[target] = value
    return out


def seam_any(tree: Tree) -> list[Finding]:
    """Rule 4 over the whole tree: Protocols in each module, the aliases they name wherever
    those are defined (the module itself, or the agent module a from-import took them from)."""
    out: list[Finding] = []
    used: dict[tuple[str, str], str] = {}     # (module, alias) -> a Protocol that names it

    def report(module: str, lines: list[int], what: str, key: str) -> None:
        for line in sorted(set(lines)):
            if _ANY_MARK.search(tree.lines[module][line - 1]):
                continue
            out.append(Finding(tree.shown(module), line, "seam-any",
                               f"Any in {what}: a seam says what it passes; name the type (a TYPE_CHECKING "
                               "import where a run-time one would be a cycle) or mark the line '# any: <reason>'",
                               key=key))

    for module in sorted(tree.syntax):
        syntax = tree.syntax[module]
        aliases = _callable_aliases(syntax)
        origin = {imp.as_name: imp.module for _, _, imps in imports(tree, module, syntax)
                  for imp in imps if imp.as_name is not None and tree.exists(imp.module)}
        for cls in (n for n in ast.walk(syntax) if isinstance(n, ast.ClassDef) and _is_protocol(n)):
            for what, ann in _annotations(cls):
                report(module, _any_lines(ann), f"seam Protocol {cls.name}.{what}", cls.name)
                for n in ast.walk(ann):
                    if isinstance(n, ast.Name) and n.id in aliases:
                        used.setdefault((module, n.id), cls.name)
                    elif isinstance(n, ast.Name) and n.id in origin:
                        used.setdefault((origin[n.id], n.id), cls.name)
    for (module, name), proto in sorted(used.items()):
        value = _callable_aliases(tree.syntax[module]).get(name) if module in tree.syntax else None
        if value is not None:
            report(module, _any_lines(value), f"{name}, a Callable alias seam Protocol {proto} names", name)
    return out
