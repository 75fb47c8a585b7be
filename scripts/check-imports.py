#!/usr/bin/env python3
"""The import rules of agent/, checked over the source with the standard library's ast
(``make lint`` runs it). One line per finding and exit status 1 when a rule is broken.

1. layers: each part of agent/ (a package, or a top-level module: ``config``, ``cli``,
   ``__main__``) imports only itself, BASE and what its row of MAY_IMPORT names. The rows
   say what the packages' ``__init__`` docstrings say; where a docstring is silent (audit,
   cloud, coordination, execute, signals, config) the row is the layering the code has,
   so that a new dependency is a decision written down here. Module-level and
   function-level imports both count: a lazy import is a run-time dependency all the
   same (its laziness is for import cost). Imports under ``if TYPE_CHECKING:`` do not:
   annotations may name anything. Dynamic imports (``importlib``) are not seen.
2. private: no module of agent/ imports a ``_private`` name from another module
   (``from agent.x import _y``, relative imports too) or reaches one through a module it
   imported (``mod._y``).
3. private-call: no call ``obj._name(...)`` on anything but ``self``, ``cls`` or
   ``super()`` of a private method that another module of agent/ defines: that is a
   private method of another module's object. Where ``_name`` is defined in the calling
   module itself, the call stays inside the module (another instance of its own class)
   and is allowed. Private methods of other libraries' objects (``c._ops_to_requests``
   of etcd3) are not ours to rename: ``--notes`` lists them without failing.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional

PACKAGE = "agent"

# Importable by every part: the package root (version constants), the typed config, and
# the runtime leaves (agent/runtime/__init__.py).
BASE = {"agent", "errors", "config", "configcheck", "runtime.loop", "runtime.metrics", "runtime.logs", "runtime.timefmt", "runtime.text",
        "runtime.recent", "runtime.kernel"}

# part -> what it may import besides itself and BASE: parts ("jobs") or modules
# ("runtime.gcpolicy", covering its submodules); "*" is anything.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": {"*"},                     # runtime/__init__: every other package
    "daemon": {"*"},                      # daemon/__init__: the composition root (demo is closed to it below)
    "demo": {"*"},                        # demo/__init__: may import anything
    "cli": {"*"},                         # cli.py: maps every subcommand to the module that owns it
    "__main__": {"cli"},
    "jobs": {"coordination", "execute", "runtime.gcpolicy"},   # jobs/__init__
    "supervision": {"signals"},           # supervision/__init__
    "cloud": {"coordination", "jobs", "cli"},   # cli: UserError for a start-up error
    "coordination": set(),
    "execute": set(),
    "signals": set(),
    "audit": set(),
    "errors": set(),                              # UserError, raised by every layer for the CLI
    "config": set(),                              # the sections and loading; configcheck validates
    "configcheck": {"coordination.placement",   # labels and targets have one syntax check
                    "jobs.paramregex"},           # and template param regexes one backtracking check
}

# A package's command module (agent/<package>/cli.py) may import agent.cli too: the
# commands share its UserError and DEFAULT_CONFIG.
COMMAND_MAY_IMPORT = {"cli"}

# a part or module -> the only parts that may import it (a part imports its own modules)
ONLY_FROM = {
    "demo": {"cli"},                      # demo/__init__: nothing in the product but the CLI
    "daemon": {"cli", "demo"},            # daemon/__init__: the composition root, run by the CLI (and the demo)
}

# a third-party module -> the only modules of agent/ that may import it
THIRD_PARTY_ONLY_IN = {
    "bcc": {"agent.signals.loader"},      # signals/__init__: only the loader process imports bcc
}

# underscore names that are public API (namedtuple's)
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_make", "_fields", "_field_defaults"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    message: str

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
        for module, path in self.modules.items():
            with open(path, encoding="utf-8") as fh:
                try:
                    tree = ast.parse(fh.read(), filename=path)
                except SyntaxError as exc:
                    self.errors.append(Finding(self.shown(module), exc.lineno or 0, "syntax", str(exc.msg)))
                    continue
            self.syntax[module] = tree
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(node.name):
                    self.defines.setdefault(node.name, set()).add(module)

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


@dataclass(frozen=True)
class Import:
    line: int
    module: str                 # the module imported (resolved, absolute)
    name: Optional[str]         # the name taken from it (a from-import of a non-module), else None
    local: Optional[str]        # the local name bound to a module by this import, else None
    bound: Optional[str]        # that module (``import a.b`` binds ``a`` to module ``a``)
    type_checking: bool


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
                    out.append(Import(node.lineno, base, a.name, None, None, tc))
            yield node.lineno, base, out
        yield from visit(node, tc)

    yield from visit(syntax, False)


def may_import(importer: str, target: str) -> bool:
    """Whether module ``importer`` may import module ``target`` (both of agent/) by the layers."""
    src, dst, rel = Tree.part(importer), Tree.part(target), Tree.rel(target)
    if src == dst:
        return True
    row = MAY_IMPORT.get(src, set())
    names = row | BASE
    if "*" in row or dst in names or rel in names or any(rel.startswith(n + ".") for n in names):
        return True
    return Tree.rel(importer).endswith(".cli") and dst in COMMAND_MAY_IMPORT


def layer_problem(importer: str, target: str) -> Optional[str]:
    """Why ``importer`` must not import ``target`` at run time, or None."""
    src, rel = Tree.part(importer), Tree.rel(target)
    only = ONLY_FROM.get(rel)
    if only is None and src != Tree.part(target):
        only = ONLY_FROM.get(Tree.part(target))
    if only is not None:
        if src in only:
            return None
        return f"imports {target}, which only {', '.join(sorted(only))} may import"
    if not may_import(importer, target):
        return f"{src} imports {target}: not in what {src} may import (MAY_IMPORT in scripts/check-imports.py)"
    return None


def _dotted(node: ast.expr) -> Optional[str]:
    """``a.b.c`` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def check_module(tree: Tree, module: str) -> tuple[list[Finding], list[Finding]]:
    """(findings, notes) of one module."""
    syntax, shown = tree.syntax[module], tree.shown(module)
    out: list[Finding] = []
    notes: list[Finding] = []
    aliases: dict[str, str] = {}       # local name -> agent module bound to it
    foreign: set[str] = set()          # local names bound to modules outside agent/

    for line, top, imps in imports(tree, module, syntax):
        lib = top.split(".")[0]
        if lib in THIRD_PARTY_ONLY_IN and module not in THIRD_PARTY_ONLY_IN[lib]:
            out.append(Finding(shown, line, "layers",
                               f"imports {lib}, which only {', '.join(sorted(THIRD_PARTY_ONLY_IN[lib]))} may"))
        for imp in imps:
            if lib != PACKAGE:
                if imp.local is not None:
                    foreign.add(imp.local)
                continue
            if imp.local is not None and imp.bound is not None:
                aliases[imp.local] = imp.bound
            if imp.name is not None and private(imp.name) and imp.module != module:
                out.append(Finding(shown, line, "private",
                                   f"imports {imp.name} from {imp.module}: a private name of another module"))
            if not imp.type_checking and tree.exists(imp.module):
                why = layer_problem(module, imp.module)
                if why:
                    out.append(Finding(shown, line, "layers", why))

    for node in ast.walk(syntax):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = _dotted(node.value)
            head = owner.split(".")[0] if owner else ""
            if owner is not None and head in aliases:
                bound = aliases[head] + owner[len(head):]
                if tree.exists(bound) and bound != module:
                    out.append(Finding(shown, node.lineno, "private",
                                       f"reaches {node.attr} of module {bound} through {owner}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and private(node.func.attr):
            recv, name = node.func.value, node.func.attr
            if isinstance(recv, ast.Name) and recv.id in ("self", "cls"):
                continue
            if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Name) and recv.func.id == "super":
                continue
            owner = _dotted(recv)
            if owner is not None and owner.split(".")[0] in aliases:
                continue               # a module's private function: the private rule reports it
            if owner is not None and owner.split(".")[0] in foreign:
                continue               # os._exit, sys._getframe: other libraries' modules
            defined = tree.defines.get(name, set())
            what = f"calls {name}() of {ast.unparse(recv)}"
            if module in defined:
                continue               # defined here: another instance of this module's own class
            if defined:
                out.append(Finding(shown, node.lineno, "private-call",
                                   f"{what}: a private method of {', '.join(sorted(defined))}"))
            else:
                notes.append(Finding(shown, node.lineno, "note", f"{what}: a private method of another library"))
    return out, notes


def check(root: str) -> tuple[list[Finding], list[Finding]]:
    """(findings, notes) for the agent/ package below ``root``. A part of agent/ without a
    row in MAY_IMPORT is a finding too: a new part says what it may import."""
    tree = Tree(root)
    out, notes = list(tree.errors), []
    seen: set[str] = set()
    for module in sorted(tree.syntax):
        part = Tree.part(module)
        if module != PACKAGE and part not in MAY_IMPORT and part not in seen:
            seen.add(part)
            out.append(Finding(tree.shown(module), 1, "layers",
                               f"{part} has no row in MAY_IMPORT (scripts/check-imports.py): say what it may import"))
        found, noted = check_module(tree, module)
        out += found
        notes += noted
    order = lambda f: (f.path, f.line, f.message)  # noqa: E731
    return sorted(out, key=order), sorted(notes, key=order)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Check the import rules of agent/ (see the module docstring).")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the source tree holding agent/ (default: this checkout)")
    ap.add_argument("--notes", action="store_true", help="also list private calls into other libraries (never fail)")
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, PACKAGE)):
        print(f"check-imports: no {PACKAGE}/ in {args.root}", file=sys.stderr)
        return 2
    findings, notes = check(args.root)
    for f in findings + (notes if args.notes else []):
        print(f)
    if findings:
        print(f"check-imports: {len(findings)} finding(s); the rules: scripts/check-imports.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
