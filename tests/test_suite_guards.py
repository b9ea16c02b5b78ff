"""Guards over the test suite itself: assertion patterns that cannot fail.

A counter that only grows, compared with ``>=`` against a snapshot taken earlier in the
same test (``assert stats().num_x >= before.num_x``), holds whether or not the work
happened. Assert what the work adds instead: ``after.num_x - before.num_x == expected``,
or at least ``>``. See docs/testing.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent

ALLOWED: dict[tuple[str, str], str] = {}
"""(file name, ``ast.unparse`` of the comparison) -> why it can fail after all (say, the
attribute can also fall), for a comparison the guard flags that is meant."""


def counter_compared_with_its_snapshot(source: str) -> list[tuple[int, str]]:
    """(line, comparison) of each ``assert A.x >= s.x`` (or ``s.x <= A.x``) where ``s`` is a
    name assigned earlier in an enclosing function and ``A`` is another expression."""
    finder = _SnapshotComparisons()
    finder.visit(ast.parse(source))
    return finder.found


class _SnapshotComparisons(ast.NodeVisitor):
    def __init__(self) -> None:
        self.scopes: list[set[str]] = []  # names assigned so far, per enclosing function
        self.found: list[tuple[int, str]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(set())
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)  # the value first: ``x = f(x)`` reads the old ``x``
        if self.scopes:
            for target in node.targets:
                self.scopes[-1].update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def visit_Assert(self, node: ast.Assert) -> None:
        snapshots = set().union(*self.scopes)
        for compare in ast.walk(node.test):
            if not isinstance(compare, ast.Compare):
                continue
            operands = [compare.left, *compare.comparators]
            for op, left, right in zip(compare.ops, operands[:-1], operands[1:], strict=True):
                pair = {ast.GtE: (left, right), ast.LtE: (right, left)}.get(type(op))
                if pair is not None and _reads_its_snapshot(*pair, snapshots):
                    self.found.append((node.lineno, ast.unparse(compare)))
        self.generic_visit(node)


def _reads_its_snapshot(later: ast.expr, earlier: ast.expr, snapshots: set[str]) -> bool:
    return (
        isinstance(later, ast.Attribute)
        and isinstance(earlier, ast.Attribute)
        and later.attr == earlier.attr
        and isinstance(earlier.value, ast.Name)
        and earlier.value.id in snapshots
        and ast.dump(later.value) != ast.dump(earlier.value)
    )


def test_no_test_compares_a_counter_with_its_own_earlier_value() -> None:
    flagged = {
        (path.name, line, comparison)
        for path in sorted(TESTS.glob("*.py"))
        for line, comparison in counter_compared_with_its_snapshot(path.read_text())
    }
    unexplained = [f"{n}:{line}: {c}" for n, line, c in flagged if (n, c) not in ALLOWED]
    assert not unexplained, "a counter compared with >= to its own snapshot cannot fail"
    stale = set(ALLOWED) - {(n, c) for n, _, c in flagged}
    assert not stale, f"ALLOWED entries that no longer match: {stale}"


def test_the_guard_flags_the_pattern_and_nothing_near_it() -> None:
    source = """
def test_counter(cluster):
    before = _spec(cluster)
    run(cluster)
    assert _spec(cluster).num_verifications >= before.num_verifications
    after = _spec(cluster)
    assert before.num_steps <= after.num_steps

def test_near_misses(cluster, rows):
    before = _spec(cluster)
    after = _spec(cluster)
    assert after.num_verifications > before.num_verifications  # progress: can fail
    assert after.num_draft_tokens - before.num_draft_tokens >= 4
    assert after.num_free_blocks >= before.num_kv_blocks  # another attribute
    assert all(b.at >= a.at for a, b in zip(rows, rows[1:]))  # not a snapshot
    assert after.steps >= CONFIG.steps  # a module constant, not a snapshot
"""
    assert counter_compared_with_its_snapshot(source) == [
        (5, "_spec(cluster).num_verifications >= before.num_verifications"),
        (7, "before.num_steps <= after.num_steps"),
    ]
