"""The source tree of agent/ as the structure rules read it (scripts/check-imports.py and
scripts/typerules.py): its modules and packages, their syntax, the imports of each, and
the names its classes define."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional

PACKAGE = "agent"

# underscore names that are public API (namedtuple's)
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    message: str
    key: str = field(default="", compare=False)    # what it is about: the attribute, Protocol, target, a cycle's modules

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


class Tree:
    """The modules below ``root``/agent: dotted name -> path, the packages among them, and
    which modules define each private function or method name."""

    def __init__(self, root: str):
        self.root = root
        self.modules: dict[str, str] = {}
        self.packages: set[str] = set()
        self.syntax: dict[str, ast.Module] = {}
        self.errors: list[Finding] = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, PACKAGE)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
            if "__init__.py" in filenames:
                self.packages.add(rel)
            for f in sorted(filenames):
                if f.endswith(".py"):
                    self.modules[rel if f == "__init__.py" else f"{rel}.{f[:-3]}"] = os.path.join(dirpath, f)
        self.defines: dict[str, set[str]] = {}   # private def name -> modules defining it
        self.attributes: set[str] = set()        # every attribute name a class of agent/ defines
        self.lines: dict[str, list[str]] = {}
        for module, path in self.modules.items():
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
                try:
                    tree = ast.parse(text, filename=path)
                except SyntaxError as exc:
                    self.errors.append(Finding(self.shown(module), exc.lineno or 0, "syntax", str(exc.msg)))
                    continue
            self.syntax[module] = tree
            self.lines[module] = text.splitlines()
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
                    self.defines.setdefault(node.name, set()).add(module)
                if isinstance(node, ast.ClassDef):
                    self.attributes |= _class_names(node)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                        and isinstance(node.value, ast.Name) and node.value.id == "self":
                    self.attributes.add(node.attr)

    def package(self, module: str) -> str:
        """The package a module is in: ``jobs`` for agent.jobs and agent.jobs.view, ``agent``
        for the top-level modules (config, configcheck, cli)."""
        parts = module.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and module in self.packages) else parts[0]

    def shown(self, module: str) -> str:
        return os.path.relpath(self.modules[module], self.root)

    def exists(self, name: str) -> bool:
        return name in self.modules

    @staticmethod
    def part(module: str) -> str:
        """The part a module belongs to: its package below agent/, or the top-level module."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    @staticmethod
    def rel(module: str) -> str:
        """``agent.jobs.view`` -> ``jobs.view``; ``agent`` stays ``agent``."""
        return module.split(".", 1)[1] if "." in module else module


def _class_names(cls: ast.ClassDef) -> set[str]:
    """The names a class body defines: methods, annotated and assigned names."""
    out = set()
    for b in cls.body:
        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(b.name)
        elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
            out.add(b.target.id)
        elif isinstance(b, ast.Assign):
            out |= {t.id for t in b.targets if isinstance(t, ast.Name)}
    return out


@dataclass(frozen=True)
class Import:
    line: int
    module: str                 # the module imported (resolved, absolute)
    name: Optional[str]         # the name taken from it (a from-import of a non-module), else None
    local: Optional[str]        # the local name bound to a module by this import, else None
    bound: Optional[str]        # that module (``import a.b`` binds ``a`` to module ``a``)
    type_checking: bool
    as_name: Optional[str] = None   # the local name a from-import of a non-module binds


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(tree: Tree, module: str, syntax: ast.AST) -> Iterator[tuple[int, str, list[Import]]]:
    """(line, module named, what it imports) for every import statement at any depth,
    relative imports resolved against the importing module; a from-import of a submodule
    (``from agent.runtime import metrics``) imports that module."""
    is_package = module in tree.packages

    def visit(node: ast.AST, tc: bool) -> Iterator[tuple[int, str, list[Import]]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for stmt in child.body:
                    yield from one(stmt, True)
                for stmt in child.orelse:
                    yield from one(stmt, tc)
            else:
                yield from one(child, tc)

    def one(node: ast.AST, tc: bool) -> Iterator[tuple[int, str, list[Import]]]:
        if isinstance(node, ast.Import):
            for a in node.names:
                bound = a.name if a.asname else a.name.split(".")[0]
                yield node.lineno, a.name, [Import(node.lineno, a.name, None, a.asname or bound, bound, tc)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(pkg) + ("." + base if base else "")
            out = []
            for a in node.names:
                sub = f"{base}.{a.name}"
                if tree.exists(sub):
                    out.append(Import(node.lineno, sub, None, a.asname or a.name, sub, tc))
                else:
                    out.append(Import(node.lineno, base, a.name, None, None, tc, a.asname or a.name))
            yield node.lineno, base, out
        yield from visit(node, tc)

    yield from visit(syntax, False)


def dotted(node: ast.expr) -> Optional[str]:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None
