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
4. seam-any: no ``Any`` in a parameter, return or attribute annotation of a class with a
   ``Protocol`` base, nor in a module-level ``Callable`` alias such a Protocol names. A seam
   says what it passes: the consumer's contract is the type. ``*args``/``**kwargs`` (JSON
   fields) are exempt, and so is a line marked ``# any: <reason>``.
5. duck: no ``getattr(x, "name", ...)``/``hasattr(x, "name")`` (a string constant, or a
   ``for`` variable over constants) where ``name`` is an attribute some class of agent/
   defines (class-body defs, annotations and assignments, ``self.name =``): on our own
   types, the type says whether the attribute is there. Exempt: a receiver that is a module
   of another library (``os``), an ``except ... as`` name, or a parameter annotated with a
   type of another library (``argparse.Namespace``); and the modules of DUCK_ADAPTERS,
   which handle other libraries' objects whose attributes vary by version.
6. cycles: no import cycle across packages (Tarjan's strongly connected components over
   the module graph; ``TYPE_CHECKING`` imports count, since the cycle they close is one of
   knowledge). A package's own modules may import each other in a cycle; the top-level
   modules (``config``, ``configcheck``, ``cli``) are one package, ``agent``.
7. upward: no import (``TYPE_CHECKING`` ones included) of a part that RANK puts higher
   than the importer's, except the pairs of UPWARD_ALLOWED, each with its reason.

Every run prints a count per rule; ``--counts`` prints the figures of the structure
(cycles, upward imports, duck and seam-any findings).

Rules 4 and 5 are in scripts/typerules.py; the source tree and its imports, as every rule
reads them, in scripts/sourcetree.py.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sourcetree import PACKAGE, Finding, Tree, dotted, imports, private  # noqa: E402
from typerules import Scope, duck, seam_any  # noqa: E402

# Importable by every part: the package root (version constants), the typed config, and
# the runtime leaves (agent/runtime/__init__.py).
BASE = {"agent", "errors", "config", "configcheck", "brokerlimits", "runtime.loop", "runtime.metrics", "runtime.logs", "runtime.timefmt", "runtime.text",
        "runtime.recent", "runtime.kernel"}

# part -> what it may import besides itself and BASE: parts ("jobs") or modules
# ("runtime.gcpolicy", covering its submodules); "*" is anything.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": {"coordination.fencing"},  # the ground floor: seams names coordination's Fence; nothing else
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
    "brokerlimits": set(),                        # the broker profiles' table (mqtt.profile, mqtt.limits)
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

# modules whose getattr/hasattr on our attribute names are about another library's objects
# (rule 5): module -> why. docs/development.md lists the same table.
DUCK_ADAPTERS = {
    "agent.cloud.mqtt": "paho 1.6/2.x objects",
    "agent.coordination.etcd": "grpc/etcd3 replies and transaction ops",
    "agent.signals.loader": "bcc table types",
    "agent.runtime.logs": "LogRecord extras",
}

# a part, or a module where it differs from its part -> its floor (rule 7): an import goes
# to the same floor or down. The composition root sits above everything it wires.
RANK = {
    "agent": 0, "errors": 0, "config": 0, "configcheck": 0, "brokerlimits": 0,
    "runtime": 0,                        # the ground floor: loop, metrics, logs, gcpolicy, timefmt, text, recent, kernel
    "runtime.seams": 1,                  # the daemon's seams name coordination's Fence
    "coordination": 1, "execute": 1, "signals": 1, "audit": 1,
    "jobs": 2, "supervision": 2,
    "cloud": 3,
    "daemon": 4,                         # the composition root: only cli and demo import it
    "cli": 5,
    "__main__": 6, "demo": 6,
}

# (importer, imported) -> why the lower floor imports the higher one (rule 7)
UPWARD_ALLOWED = {
    ("configcheck", "coordination.placement"): "labels and targets have one syntax check, placement's",
    ("configcheck", "jobs.paramregex"): "template param regexes have one backtracking check, paramregex's",
}

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


def check_module(tree: Tree, module: str) -> tuple[list[Finding], list[Finding]]:
    """(findings, notes) of one module."""
    syntax, shown = tree.syntax[module], tree.shown(module)
    out: list[Finding] = []
    notes: list[Finding] = []
    aliases: dict[str, str] = {}       # local name -> agent module bound to it
    foreign: set[str] = set()          # local names bound to modules outside agent/
    names: dict[str, str] = {}         # local name -> module a from-import took it from

    for line, top, imps in imports(tree, module, syntax):
        lib = top.split(".")[0]
        if lib in THIRD_PARTY_ONLY_IN and module not in THIRD_PARTY_ONLY_IN[lib]:
            out.append(Finding(shown, line, "layers",
                               f"imports {lib}, which only {', '.join(sorted(THIRD_PARTY_ONLY_IN[lib]))} may"))
        for imp in imps:
            if imp.as_name is not None:
                names[imp.as_name] = imp.module
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
            owner = dotted(node.value)
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
            owner = dotted(recv)
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
    if module not in DUCK_ADAPTERS:
        out += duck(tree, module, Scope(foreign, set(aliases), names))
    return out, notes


def import_graph(tree: Tree) -> tuple[dict[str, dict[str, int]], set[tuple[str, str]]]:
    """(module -> the agent modules it imports, TYPE_CHECKING imports too -> first line;
    the pairs imported at run time)."""
    edges: dict[str, dict[str, int]] = {}
    run_time: set[tuple[str, str]] = set()
    for module in sorted(tree.syntax):
        for line, _, imps in imports(tree, module, tree.syntax[module]):
            for imp in imps:
                if imp.module != module and tree.exists(imp.module):
                    edges.setdefault(module, {}).setdefault(imp.module, line)
                    if not imp.type_checking:
                        run_time.add((module, imp.module))
    return edges, run_time


def components(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return sorted(out)


def cycles(tree: Tree, edges: dict[str, dict[str, int]]) -> list[Finding]:
    """Rule 6: a strongly connected component whose modules are in more than one package."""
    out = []
    for comp in components(edges):
        packages = sorted({tree.package(m) for m in comp})
        if len(packages) < 2:
            continue
        first = comp[0]
        line = min(n for m, n in edges[first].items() if m in comp)
        out.append(Finding(tree.shown(first), line, "cycles",
                           f"an import cycle across {', '.join(packages)} (TYPE_CHECKING imports count): "
                           f"{', '.join(comp)}; cut it with a Protocol where the caller is, or a value passed in",
                           key=" ".join(comp)))
    return out


def rank(module: str) -> Optional[int]:
    rel = Tree.rel(module)
    parts = rel.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return RANK[".".join(parts[:n])]
    return RANK.get(Tree.part(module))


def upward(tree: Tree, edges: dict[str, dict[str, int]], run_time: set[tuple[str, str]]) -> tuple[list[Finding], int, int]:
    """Rule 7: (findings, the allowed pairs, the pairs rule 1 reports already). A part
    without a RANK is a finding."""
    out, allowed, layered = [], 0, 0
    for part in sorted({Tree.part(m) for m in tree.syntax} - {PACKAGE}):
        if part not in RANK:
            out.append(Finding("scripts/check-imports.py", 1, "upward",
                               f"{part} has no floor in RANK: say where it sits", key=part))
    for src in sorted(edges):
        for dst, line in sorted(edges[src].items()):
            a, b = rank(src), rank(dst)
            if a is None or b is None or b <= a or Tree.part(src) == Tree.part(dst):
                continue
            if Tree.rel(src).endswith(".cli") and Tree.part(dst) in COMMAND_MAY_IMPORT:
                continue
            if Tree.part(src) in ONLY_FROM.get(Tree.part(dst), ()):
                continue                 # the importers ONLY_FROM names: the CLI runs the demo
            if (Tree.part(src), Tree.rel(dst)) in UPWARD_ALLOWED or (Tree.rel(src), Tree.rel(dst)) in UPWARD_ALLOWED:
                allowed += 1
                continue
            if (src, dst) in run_time and layer_problem(src, dst):
                layered += 1             # one finding per breach: the layers rule names it
                continue
            out.append(Finding(tree.shown(src), line, "upward",
                               f"imports {dst}, a floor above it (RANK in scripts/check-imports.py): pass a value "
                               "or a Protocol down instead, or write the pair and why in UPWARD_ALLOWED",
                               key=Tree.rel(dst)))
    return out, allowed, layered


@dataclass
class Result:
    findings: list[Finding]
    notes: list[Finding]
    allowed_upward: int
    layered_upward: int          # upward pairs the layers rule reports
    cycle_modules: int


def analyse(root: str) -> Result:
    """Every rule over the agent/ package below ``root``."""
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
    out += seam_any(tree)
    edges, run_time = import_graph(tree)
    found_cycles = cycles(tree, edges)
    up, allowed, layered = upward(tree, edges, run_time)
    out += found_cycles + up
    order = lambda f: (f.path, f.line, f.message)  # noqa: E731
    return Result(sorted(out, key=order), sorted(notes, key=order), allowed, layered,
                  sum(len(f.key.split()) for f in found_cycles))


RULES = ("layers", "private", "private-call", "seam-any", "duck", "cycles", "upward")


def counts(r: Result) -> str:
    """One line: the findings of each rule."""
    return "check-imports: " + ", ".join(f"{rule} {sum(f.rule == rule for f in r.findings)}" for rule in RULES)


def figures(r: Result) -> str:
    """The structure's figures: what the closing note quotes."""
    n = lambda rule: sum(f.rule == rule for f in r.findings)  # noqa: E731
    pairs = n("upward") + r.allowed_upward + r.layered_upward
    return "\n".join([
        f"cross-package import cycles: {n('cycles')} ({r.cycle_modules} modules)",
        f"upward imports: {pairs} module pairs ({r.allowed_upward} allowed in UPWARD_ALLOWED, "
        f"{r.layered_upward} reported by the layers rule)",
        f"duck (getattr/hasattr on our attribute names): {n('duck')}",
        f"seam-any (Any in seam Protocols and their aliases): {n('seam-any')}",
    ])


def check(root: str) -> tuple[list[Finding], list[Finding]]:
    """(findings, notes) for the agent/ package below ``root``. A part of agent/ without a
    row in MAY_IMPORT is a finding too: a new part says what it may import."""
    r = analyse(root)
    return r.findings, r.notes


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Check the import rules of agent/ (see the module docstring).")
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the source tree holding agent/ (default: this checkout)")
    ap.add_argument("--notes", action="store_true", help="also list private calls into other libraries (never fail)")
    ap.add_argument("--counts", action="store_true",
                    help="print the figures of the structure (cycles, upward imports, duck, seam-any)")
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, PACKAGE)):
        print(f"check-imports: no {PACKAGE}/ in {args.root}", file=sys.stderr)
        return 2
    r = analyse(args.root)
    findings = r.findings
    for f in findings + (r.notes if args.notes else []):
        print(f)
    print(counts(r))
    if args.counts:
        print(figures(r))
    if findings:
        print(f"check-imports: {len(findings)} finding(s); the rules: scripts/check-imports.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
