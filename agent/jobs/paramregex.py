"""Template param regexes that match in linear time, checked when the config is loaded.

Python's ``re`` backtracks: ``(a|a)*b`` takes 2^n steps on ``a``\\*n and ``\\w*\\w*\\w*\\w*!``
n^4; the 1024-character cap on a value bounds nothing at those rates. No linear-time
engine is packaged for Debian's Python, so :func:`regex_risk` refuses every pattern whose
worst case could be more than linear, before any value is matched. It parses the pattern
itself (a subset of ``re``'s syntax: anything outside it is refused) and builds the
automaton a backtracking matcher walks: one state per character-class occurrence, an edge
for each way (counted) of reaching the next one. It refuses

- exponential ambiguity: a state with two different paths back to itself reading the same
  text: overlapping alternatives or nested repeats under a repeat (``(a|a)*``,
  ``(a|ab|b)*``, ``(a+)+``, ``(.*,)*``); an unambiguous nested repeat such as
  ``[a-z]+(\\.[a-z]+)*`` is accepted;
- polynomial ambiguity: two states, each on a loop, where a text that loops on the first
  also leads from it to the second and loops there: repeats one after another that can
  match the same text (``\\w*\\w*``, ``\\d+\\.?\\d*``, ``.*x.*``).

Without these a backtracking matcher tries each input position a bounded number of ways
(Weideman, van der Merwe, Berglund, Watson: "Analyzing matching time behavior of
backtracking regular expression matchers by using ambiguity of NFA", 2016).

No false negatives, because the automaton has at least the paths ``re`` can try: a bounded
repeat ``x{m,n}`` with n >= 2 is modelled as ``x+`` (or ``x*``), zero-width assertions
(``^ $ \\A \\Z \\b \\B``) as always matching, atomic groups and possessive repeats as plain
ones, and case-insensitive classes with both cases. What it cannot model is refused:
backreferences, lookarounds, conditionals, verbose mode, global flags after the start, a
repeat whose body can match the empty text, and patterns past its work budget. False
positives exist (``[0-9]{4}[0-9]{2}`` is modelled as ``[0-9]+[0-9]+``: write ``[0-9]{6}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

MAX_STATES = 400          # character-class occurrences in one pattern
MAX_WORK = 200_000        # steps of the ambiguity checks (pairs and triples of moves examined)

MAX_CHAR = 0x10FFFF

EXPONENTIAL = ("regex can match the same text in more than one way inside a repeat (overlapping alternatives or "
               "nested repeats, like (a|a)*, (a|ab|b)* or (a+)+), which can backtrack for exponential time on a "
               "hostile value: make the repeated part match each text one way only")
POLYNOMIAL = ("regex has repeats one after another that can match the same text (like \\w*\\w* or \\d+\\.?\\d*), "
              "which can backtrack for polynomial time on a hostile value: separate them by a character only "
              "one of them matches, or merge them")
EMPTY_BODY = ("regex repeats something that can match the empty text (like (a?)* or (a|)+), which can "
              "backtrack without bound: make the repeated part match at least one character")
TOO_LARGE = "regex is too large to check for catastrophic backtracking: split or simplify it"


class Unsupported(Exception):
    """A construct the check cannot model; the pattern is refused with this reason."""


@dataclass(frozen=True)
class CharSet:
    """A set of characters as sorted, disjoint, non-adjacent inclusive code point ranges."""

    spans: tuple = ()

    @staticmethod
    def of(*codes: int) -> "CharSet":
        return CharSet.ranges(*((c, c) for c in codes))

    @staticmethod
    def ranges(*spans: tuple) -> "CharSet":
        merged: list = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return CharSet(tuple(merged))

    def union(self, other: "CharSet") -> "CharSet":
        return CharSet.ranges(*self.spans, *other.spans)

    def intersection(self, other: "CharSet") -> "CharSet":
        out, i, j = [], 0, 0
        while i < len(self.spans) and j < len(other.spans):
            lo = max(self.spans[i][0], other.spans[j][0])
            hi = min(self.spans[i][1], other.spans[j][1])
            if lo <= hi:
                out.append((lo, hi))
            if self.spans[i][1] < other.spans[j][1]:
                i += 1
            else:
                j += 1
        return CharSet(tuple(out))

    def empty(self) -> bool:
        return not self.spans

    def complement(self) -> "CharSet":
        out, nxt = [], 0
        for lo, hi in self.spans:
            if lo > nxt:
                out.append((nxt, lo - 1))
            nxt = hi + 1
        if nxt <= MAX_CHAR:
            out.append((nxt, MAX_CHAR))
        return CharSet(tuple(out))

    def folded(self) -> "CharSet":
        """Under IGNORECASE (ASCII): both cases of every letter in the set (a negated class
        is folded after its negation: more than re matches, never less)."""
        letters = [c ^ 0x20 for rng in (LOWER, UPPER) for c in range(rng[0], rng[1] + 1)
                   if not self.intersection(CharSet.of(c)).empty()]
        return self.union(CharSet.of(*letters))


LOWER, UPPER = (ord("a"), ord("z")), (ord("A"), ord("Z"))
DIGITS = CharSet.ranges((ord("0"), ord("9")))
ANY = CharSet(((0, MAX_CHAR),))
NOT_NEWLINE = CharSet.of(ord("\n")).complement()
CATEGORIES = {"d": DIGITS, "w": CharSet.ranges((ord("0"), ord("9")), LOWER, UPPER, (ord("_"), ord("_"))),
              "s": CharSet.of(*map(ord, " \t\n\r\f\v"))}


# --------------------------------------------------------------------------- syntax tree

@dataclass(frozen=True)
class Chars:
    chars: CharSet


@dataclass(frozen=True)
class Empty:
    """The empty text, or a zero-width assertion (modelled as always true)."""


@dataclass(frozen=True)
class Cat:
    items: tuple


@dataclass(frozen=True)
class Alt:
    branches: tuple


@dataclass(frozen=True)
class Repeat:
    body: "Node"
    lo: int
    hi: Optional[int]   # None: unbounded


Node = Union[Chars, Empty, Cat, Alt, Repeat]


class _Parser:
    """Python ``re`` syntax (compiled with re.ASCII) into the tree above. Called only on
    patterns ``re`` compiled: its errors need not be reported again, only never
    misread as something safer."""

    def __init__(self, pattern: str):
        self.p = pattern
        self.i = 0
        self.states = 0

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def take(self) -> str:
        c = self.peek()
        self.i += 1
        return c

    def parse(self) -> Node:
        flags = self.global_flags()
        node = self.alternation(flags)
        if self.i < len(self.p):
            raise Unsupported(f"unbalanced ')' at position {self.i}")
        return node

    def global_flags(self) -> frozenset:
        flags: set = set()
        while self.p.startswith("(?", self.i) and self.peek(2) and self.peek(2) in "aiLmsux":
            j = self.i + 2
            while j < len(self.p) and self.p[j] in "aiLmsux":
                j += 1
            if j >= len(self.p) or self.p[j] != ")":
                break   # a scoped group (?i:...), read where it stands
            flags |= set(self.p[self.i + 2:j])
            self.i = j + 1
        return self.check_flags(flags)

    @staticmethod
    def check_flags(flags: set) -> frozenset:
        if "x" in flags:
            raise Unsupported("verbose mode (?x)")
        if "L" in flags or "u" in flags:
            raise Unsupported("the L or u flag")
        return frozenset(flags)

    def alternation(self, flags: frozenset) -> Node:
        branches = [self.sequence(flags)]
        while self.peek() == "|":
            self.take()
            branches.append(self.sequence(flags))
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self, flags: frozenset) -> Node:
        items: list = []
        while self.peek() and self.peek() not in "|)":
            atom = self.atom(flags)
            if atom is None:
                continue
            items.append(self.quantified(atom))
        return Cat(tuple(items)) if len(items) != 1 else items[0]

    def quantified(self, atom: Node) -> Node:
        c = self.peek()
        if c in ("*", "+", "?") and c:
            self.take()
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            bounds = self.braces()
            if bounds is None:
                return atom
            lo, hi = bounds
        else:
            return atom
        if self.peek() in ("?", "+") and self.peek():
            self.take()   # lazy or possessive: fewer paths than the greedy repeat modelled
        return Repeat(atom, lo, hi)

    def braces(self) -> Optional[tuple]:
        """``{m}``, ``{m,}``, ``{,n}``, ``{m,n}``, ``{,}`` as ``re`` reads them; anything
        else is a literal ``{`` (left for the caller to read as an atom)."""
        j = self.i + 1
        k = j
        while k < len(self.p) and self.p[k].isdigit() and self.p[k].isascii():
            k += 1
        lo_s = self.p[j:k]
        hi_s = lo_s
        if k < len(self.p) and self.p[k] == ",":
            m = k + 1
            while m < len(self.p) and self.p[m].isdigit() and self.p[m].isascii():
                m += 1
            hi_s = self.p[k + 1:m]
            k = m
        if self.p[self.i + 1:self.i + 2] == "}" or k >= len(self.p) or self.p[k] != "}":
            return None
        self.i = k + 1
        return (int(lo_s) if lo_s else 0), (int(hi_s) if hi_s else None)

    def chars(self, cs: CharSet, flags: frozenset) -> Chars:
        self.states += 1
        if self.states > MAX_STATES:
            raise Unsupported(TOO_LARGE)
        return Chars(cs.folded() if "i" in flags else cs)

    def literal(self, c: str, flags: frozenset) -> Chars:
        return self.chars(CharSet.of(ord(c)), flags)

    def atom(self, flags: frozenset) -> Optional[Node]:
        c = self.take()
        if c == "(":
            return self.group(flags)
        if c == "[":
            return self.chars(self.char_class(), flags)
        if c == ".":
            return self.chars(ANY if "s" in flags else NOT_NEWLINE, flags)
        if c in ("^", "$"):
            return Empty()
        if c == "\\":
            return self.escape(flags)
        return self.literal(c, flags)   # "{" too: re reads it as a repeat only after an atom

    def group(self, flags: frozenset) -> Optional[Node]:
        if self.peek() != "?":
            return self.group_body(flags)
        self.take()
        c = self.take()
        if c == ":":
            return self.group_body(flags)
        if c == ">":
            return self.group_body(flags)   # atomic: fewer paths than the plain group modelled
        if c == "P" and self.peek() == "<":
            end = self.p.find(">", self.i)
            if end < 0:
                raise Unsupported("an unterminated group name")
            self.i = end + 1
            return self.group_body(flags)
        if c == "P" and self.peek() == "=":
            raise Unsupported("a backreference (?P=name)")
        if c == "#":
            end = self.p.find(")", self.i)
            if end < 0:
                raise Unsupported("an unterminated comment")
            self.i = end + 1
            return None
        if c in ("=", "!") or (c == "<" and self.peek() in ("=", "!")):
            raise Unsupported("a lookaround assertion")
        if c == "(":
            raise Unsupported("a conditional group")
        # flags: (?flags-flags:...) scoped; (?flags) here is not at the start
        on, off = "", ""
        self.i -= 1
        while self.peek() and self.peek() in "aiLmsux":
            on += self.take()
        if self.peek() == "-":
            self.take()
            while self.peek() and self.peek() in "aiLmsux":
                off += self.take()
        closer = self.take()
        if closer == ")":
            raise Unsupported("global flags after the start of the pattern")
        if closer != ":":
            raise Unsupported(f"the group syntax (?{on}{'-' + off if off else ''}{closer}")
        scoped = self.check_flags((set(flags) | set(on)) - set(off))
        return self.group_body(scoped)

    def group_body(self, flags: frozenset) -> Node:
        node = self.alternation(flags)
        if self.take() != ")":
            raise Unsupported("an unterminated group")
        return node

    def escape(self, flags: frozenset) -> Node:
        c = self.take()
        if c in ("A", "Z", "b", "B"):
            return Empty()
        if c.lower() in CATEGORIES:
            cs = CATEGORIES[c.lower()]
            return self.chars(cs.complement() if c.isupper() else cs, flags)
        code = self.escaped_char(c, in_class=False)
        return self.chars(CharSet.of(code), flags)

    def escaped_char(self, c: str, in_class: bool) -> int:
        """The code point of an escape other than a category (``\\d`` ...)."""
        simple = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
        if c in simple:
            return simple[c]
        if in_class and c == "b":
            return 8
        if c in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + width]
            self.i += width
            try:
                return int(digits, 16)
            except ValueError:
                raise Unsupported(f"the escape \\{c}{digits}") from None
        if c == "0" or (c in "1234567" and in_class):
            digits = c
            while len(digits) < 3 and self.peek() and self.peek() in "01234567":
                digits += self.take()
            return int(digits, 8)
        if c.isdigit():
            if (c in "0123" and self.peek() and self.peek() in "01234567" and self.peek(1)
                    and self.peek(1) in "01234567"):
                digits = c + self.take() + self.take()
                return int(digits, 8)
            raise Unsupported("a backreference")
        if c == "N":
            raise Unsupported("a named character escape \\N{...}")
        if not c:
            raise Unsupported("a trailing backslash")
        if c.isascii() and c.isalpha():
            raise Unsupported(f"the escape \\{c}")
        return ord(c)

    def char_class(self) -> CharSet:
        negate = self.peek() == "^"
        if negate:
            self.take()
        start = self.i
        acc = CharSet()
        while True:
            c = self.take()
            if not c:
                raise Unsupported("an unterminated character class")
            if c == "]" and self.i - 1 != start:
                break
            item: Union[CharSet, int]
            if c == "\\":
                e = self.take()
                if e.lower() in CATEGORIES:
                    cs = CATEGORIES[e.lower()]
                    item = cs.complement() if e.isupper() else cs
                else:
                    item = self.escaped_char(e, in_class=True)
            else:
                item = ord(c)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.take()
                e = self.take()
                hi = self.escaped_char(self.take(), in_class=True) if e == "\\" else ord(e)
                if not isinstance(item, int):
                    raise Unsupported("a range from a character category")
                acc = acc.union(CharSet.ranges((item, hi)))
                continue
            acc = acc.union(item if isinstance(item, CharSet) else CharSet.of(item))
        return acc.complement() if negate else acc


# --------------------------------------------------------------------------- the automaton

class _Automaton:
    """The tree as a graph: a node per character-class occurrence (``label``) and per
    junction; edges leave a character node after its character is read."""

    def __init__(self) -> None:
        self.label: dict[int, CharSet] = {}
        self.edges: dict[int, list[int]] = {}
        self.count = 0

    def node(self, label: Optional[CharSet] = None) -> int:
        n = self.count
        self.count += 1
        self.edges[n] = []
        if label is not None:
            self.label[n] = label
        return n

    def link(self, a: int, b: int) -> None:
        self.edges[a].append(b)

    def build(self, t: Node) -> tuple[int, int]:
        """(entry, exit) of the fragment for ``t``."""
        if isinstance(t, Chars):
            n = self.node(t.chars)
            return n, n
        if isinstance(t, Empty) or (isinstance(t, Cat) and not t.items):
            n = self.node()
            return n, n
        if isinstance(t, Cat):
            parts = [self.build(x) for x in t.items]
            for (_, a), (b, _) in zip(parts, parts[1:]):
                self.link(a, b)
            return parts[0][0], parts[-1][1]
        if isinstance(t, Alt):
            s, e = self.node(), self.node()
            for x in t.branches:
                a, b = self.build(x)
                self.link(s, a)
                self.link(b, e)
            return s, e
        assert isinstance(t, Repeat)
        if t.hi == 0:
            n = self.node()
            return n, n
        a, b = self.build(t.body)
        if t.hi == 1:
            if t.lo >= 1:
                return a, b
            s, e = self.node(), self.node()
            self.link(s, a)
            self.link(s, e)
            self.link(b, e)
            return s, e
        # x{m,n} with n >= 2, x{m,}: modelled as x+ (m >= 1) or x*: more paths, never fewer
        s, loop, e = self.node(), self.node(), self.node()
        self.link(s, a if t.lo >= 1 else loop)
        self.link(b, loop)
        self.link(loop, a)
        self.link(loop, e)
        return s, e

    def successors(self, start: int) -> dict[int, int]:
        """Character nodes reached from ``start`` (after its character, if it has one)
        through junctions only, with the number of distinct ways (capped at 2). Raises
        Unsupported on a cycle of junctions (a repeat whose body can match empty)."""
        ways: dict[int, int] = {}
        memo: dict[int, dict[int, int]] = {}
        active: set[int] = set()

        def closure(n: int) -> dict[int, int]:
            if n in memo:
                return memo[n]
            if n in active:
                raise Unsupported(EMPTY_BODY)
            active.add(n)
            out: dict[int, int] = {}
            for m in self.edges[n]:
                if m in self.label:
                    out[m] = min(2, out.get(m, 0) + 1)
                else:
                    for k, w in closure(m).items():
                        out[k] = min(2, out.get(k, 0) + w)
            active.discard(n)
            memo[n] = out
            return out

        for m in self.edges[start]:
            if m in self.label:
                ways[m] = min(2, ways.get(m, 0) + 1)
            else:
                for k, w in closure(m).items():
                    ways[k] = min(2, ways.get(k, 0) + w)
        return ways


def _sccs(nodes: list, succ: dict) -> list[list]:
    """Strongly connected components of a graph given as node -> {successor: weight}
    (iterative Tarjan)."""
    index: dict = {}
    low: dict = {}
    on: set = set()
    stack: list = []
    out: list[list] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(succ.get(root, {})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(succ.get(w, {}))))
                    advanced = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


class _Budget:
    """Steps the ambiguity checks may take (one per pair or triple of moves examined)."""

    def __init__(self) -> None:
        self.left = MAX_WORK

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise Unsupported(TOO_LARGE)


def _masks(labels: dict[int, CharSet]) -> dict[int, int]:
    """Each label as a bit mask over the atoms of the alphabet (the pieces no label
    splits), so that a common character of two or three labels is one AND."""
    cuts = {0, MAX_CHAR + 1}
    for cs in labels.values():
        for lo, hi in cs.spans:
            cuts.update((lo, hi + 1))
    bounds = sorted(cuts)
    atom_of: dict[tuple, int] = {}
    masks = dict.fromkeys(labels, 0)
    for lo, nxt in zip(bounds, bounds[1:]):
        piece = CharSet(((lo, nxt - 1),))
        holders = tuple(n for n, cs in labels.items() if not cs.intersection(piece).empty())
        if holders:
            bit = 1 << atom_of.setdefault(holders, len(atom_of))
            for n in holders:
                masks[n] |= bit
    return masks


def _exponential(comp: set[int], succ: dict[int, dict[int, int]], mask: dict[int, int], budget: _Budget) -> bool:
    """Two different paths from a state of ``comp`` back to it reading the same text: in
    the product of ``comp`` with itself, a component holding a pair (q, q) and an edge
    taken two different ways."""
    inside = {n: [(m, w) for m, w in succ[n].items() if m in comp] for n in comp}
    pairs = [(p, q) for p in comp for q in comp]
    edges: dict[tuple, dict[tuple, int]] = {}
    for p, q in pairs:
        out: dict[tuple, int] = {}
        for p2, wp in inside[p]:
            budget.spend(len(inside[q]) + 1)
            for q2, _ in inside[q]:
                if mask[p2] & mask[q2]:
                    # two ways: different moves, or the same move with two routes to it
                    twice = (p, p2) != (q, q2) or wp > 1
                    out[(p2, q2)] = max(out.get((p2, q2), 0), 2 if twice else 1)
        edges[(p, q)] = out
    for c in _sccs(pairs, edges):
        members = set(c)
        if not any(p == q for p, q in members):
            continue
        for a in members:
            for b, w in edges[a].items():
                if b in members and w > 1:
                    return True
    return False


def _polynomial(loops: list[int], succ: dict[int, dict[int, int]], mask: dict[int, int],
                scc_of: dict[int, int], budget: _Budget) -> bool:
    """States p != q, each on a loop, and a text w with p -w-> p, p -w-> q, q -w-> q: in
    the product of three copies, (p, p, q) reaches (p, q, q)."""
    pred: dict[int, list[int]] = {n: [] for n in succ}
    for n, out in succ.items():
        for m in out:
            pred[m].append(n)

    def closure(start: int, edges: dict) -> frozenset:
        seen, todo = {start}, [start]
        while todo:
            for m in edges[todo.pop()]:
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        budget.spend(len(seen))
        return frozenset(seen)

    reach = {n: closure(n, succ) for n in loops}
    coreach = {n: closure(n, pred) for n in loops}
    # a loop's copy stays in its own component (it comes back)
    within = {n: [m for m in succ[n] if scc_of[m] == scc_of[n]] for n in succ}
    for p in loops:
        for q in loops:
            if p == q or q not in reach[p]:
                continue
            middle = reach[p] & coreach[q]   # the middle copy goes from p to q
            budget.spend(len(middle))
            goal = (p, q, q)
            seen = {(p, p, q)}
            todo = [(p, p, q)]
            while todo:
                a, b, c = todo.pop()
                seconds = [m for m in succ[b] if m in middle]
                for a2 in within[a]:
                    budget.spend(len(seconds) + 1)
                    for b2 in seconds:
                        ab = mask[a2] & mask[b2]
                        if not ab:
                            continue
                        budget.spend(len(within[c]))
                        for c2 in within[c]:
                            if not ab & mask[c2]:
                                continue
                            nxt = (a2, b2, c2)
                            if nxt == goal:
                                return True
                            if nxt not in seen:
                                seen.add(nxt)
                                todo.append(nxt)
    return False


def parse(pattern: str) -> Node:
    """The pattern's tree; raises Unsupported."""
    return _Parser(pattern).parse()


def regex_risk(pattern: str) -> Optional[str]:
    """Why ``pattern`` could take more than linear time to match a hostile value (one line,
    for the config error), or None when it cannot. Call it on patterns ``re`` compiles."""
    try:
        tree = parse(pattern)
        auto = _Automaton()
        entry, _ = auto.build(tree)
        first = auto.node()
        auto.link(first, entry)
        succ = {n: auto.successors(n) for n in auto.label}
        seen, todo = set(), list(auto.successors(first))
        while todo:   # only what a match can reach
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(succ[n])
        nodes = sorted(seen)
        succ = {n: {m: w for m, w in succ[n].items() if m in seen} for n in nodes}
        mask = _masks({n: auto.label[n] for n in nodes})
        scc_of: dict[int, int] = {}
        loops: list[int] = []
        budget = _Budget()
        comps = _sccs(nodes, succ)
        for i, comp in enumerate(comps):
            for n in comp:
                scc_of[n] = i
            if len(comp) > 1 or comp[0] in succ[comp[0]]:
                loops.extend(comp)
                if _exponential(set(comp), succ, mask, budget):
                    return EXPONENTIAL
        if _polynomial(loops, succ, mask, scc_of, budget):
            return POLYNOMIAL
        return None
    except Unsupported as exc:
        reason = str(exc)
        if reason in (EMPTY_BODY, TOO_LARGE):
            return reason
        return f"regex uses {reason}, which the backtracking check cannot analyse: write it without"
    except RecursionError:
        return TOO_LARGE
