"""The subset of Python's regex syntax a template param may use, parsed into a tree of
character classes, concatenations, alternations and repeats (agent/jobs/paramregex.py
checks the tree for catastrophic backtracking). Anything outside the subset raises
Unsupported, and the pattern is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

MAX_STATES = 400          # character-class occurrences in one pattern
MAX_CHAR = 0x10FFFF
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


def parse(pattern: str) -> Node:
    """The pattern's tree; raises Unsupported."""
    return _Parser(pattern).parse()
