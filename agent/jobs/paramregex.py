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

from typing import Optional

from agent.jobs.regexsyntax import MAX_CHAR, TOO_LARGE, Alt, Cat, Chars, CharSet, Empty, Node, Repeat, Unsupported, parse

MAX_WORK = 200_000        # steps of the ambiguity checks (pairs and triples of moves examined)

EXPONENTIAL = ("regex can match the same text in more than one way inside a repeat (overlapping alternatives or "
               "nested repeats, like (a|a)*, (a|ab|b)* or (a+)+), which can backtrack for exponential time on a "
               "hostile value: make the repeated part match each text one way only")
POLYNOMIAL = ("regex has repeats one after another that can match the same text (like \\w*\\w* or \\d+\\.?\\d*), "
              "which can backtrack for polynomial time on a hostile value: separate them by a character only "
              "one of them matches, or merge them")
EMPTY_BODY = ("regex repeats something that can match the empty text (like (a?)* or (a|)+), which can "
              "backtrack without bound: make the repeated part match at least one character")


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
