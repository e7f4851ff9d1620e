"""A lab's bug bank: its realistic mistakes (``BUGS``) and correct alternatives (``ALTERNATIVES``),
loaded, checked against the lab's notebook, and injected into a copy of the solution.

The bank's format is solutions/BUGBANK.md's. :func:`check_bank` holds a bank to its rules (every
graded function has at least three bugs and two alternatives, every name unique, every cell and test
the notebook's); :func:`inject` puts one entry into the solution (``code`` replaces the cell,
``replace`` swaps exact text that occurs once), for the selftest to grade.
"""
from __future__ import annotations

import copy
import runpy
from collections import Counter

from autograder.course.cells import grade_id, nbg
from autograder.course.labs import bank_file


class BankError(ValueError):
    pass


def load_bank(lab: str) -> dict:
    path = bank_file(lab)
    if not path.is_file():
        return {"BUGS": [], "ALTERNATIVES": [], "NOT_GRADED": [], "RELEASE_MAY_PASS": [], "path": None}
    ns = runpy.run_path(str(path))
    return {"BUGS": list(ns.get("BUGS", [])), "ALTERNATIVES": list(ns.get("ALTERNATIVES", [])),
            "NOT_GRADED": list(ns.get("NOT_GRADED", [])),
            "RELEASE_MAY_PASS": list(ns.get("RELEASE_MAY_PASS", [])), "path": path}


def alternative_tests(bank: dict, alt: dict) -> list[str]:
    """The tests an alternative must pass in the quick selftest: its own ``tests``, else every
    test a bug of the same cell must fail (the tests that depend on that cell)."""
    if alt.get("tests"):
        return list(alt["tests"])
    return sorted({t for b in bank["BUGS"] if b.get("cell") == alt.get("cell") for t in b.get("catches", [])})


def inject(bug: dict, solution_nbs: dict) -> dict:
    """{notebook: nb} = the solution submission with bug['cell'] broken."""
    nbs = copy.deepcopy(solution_nbs)
    hits = [(n, c) for n, nb in nbs.items() for c in nb.cells
            if grade_id(c) == bug["cell"] and (bug.get("notebook") in (None, n))]
    if len(hits) != 1:
        raise BankError(f"bug {bug.get('name')!r}: cell {bug['cell']!r} not found exactly once")
    _, cell = hits[0]
    if not nbg(cell).get("solution"):
        raise BankError(f"bug {bug['name']!r}: cell {bug['cell']!r} is not a solution cell")
    if ("code" in bug) == ("replace" in bug):
        raise BankError(f"bug {bug['name']!r}: give exactly one of 'code' or 'replace'")
    if "code" in bug:
        cell.source = bug["code"].strip("\n")
    else:
        src = cell.source
        for old, new in bug["replace"]:
            if src.count(old) != 1:
                raise BankError(f"bug {bug['name']!r}: {old!r} occurs {src.count(old)} times "
                                f"in cell {bug['cell']!r} (must be exactly once)")
            src = src.replace(old, new)
        cell.source = src
    return nbs


def check_bank(lab: str, bank: dict, source_nbs: dict) -> list[str]:
    problems = []
    sol_cells = {grade_id(c) for nb in source_nbs.values() for c in nb.cells
                 if nbg(c).get("solution") and c.cell_type == "code"}
    tests = {grade_id(c) for nb in source_nbs.values() for c in nb.cells
             if nbg(c).get("grade") and not nbg(c).get("solution")}
    names = Counter(b.get("name") for b in bank["BUGS"] + bank["ALTERNATIVES"])
    unfinished = [b.get("name") for b in bank["BUGS"] + bank["ALTERNATIVES"] if b.get("unfinished")]
    if unfinished:
        problems.append(f"unfinished (stubs of `python -m autograder new-exercise`: write their code and why, then "
                        f"drop unfinished=True): {', '.join(map(str, unfinished))}")
    problems += [f"duplicate bug or alternative name {n!r}" for n, k in names.items() if k > 1]
    alts = Counter()
    for a in bank["ALTERNATIVES"]:
        if a.get("cell") not in sol_cells or "name" not in a:
            problems.append(f"alternative {a.get('name')!r}: {a.get('cell')!r} is not a code solution cell")
        problems += [f"alternative {a.get('name')!r}: {t!r} is not a test cell"
                     for t in alternative_tests(bank, a) if t not in tests]
        alts[a.get("function", a.get("cell"))] += 1
    per_fn = Counter()
    for b in bank["BUGS"]:
        for key in ("name", "cell", "catches"):
            if key not in b:
                problems.append(f"bug {b.get('name')!r} has no {key!r}")
        if b.get("cell") not in sol_cells:
            problems.append(f"bug {b.get('name')!r}: {b.get('cell')!r} is not a code solution cell")
        for t in b.get("catches", []):
            if t not in tests:
                problems.append(f"bug {b.get('name')!r}: {t!r} is not a test cell")
        per_fn[b.get("function", b.get("cell"))] += 1
    for cell in sorted(sol_cells - set(bank["NOT_GRADED"])):
        if per_fn[cell] < 3:
            problems.append(f"graded function {cell!r} has {per_fn[cell]} bugs in the bank (need >= 3)")
        if alts[cell] < 2:
            problems.append(f"graded function {cell!r} has {alts[cell]} correct alternatives in the bank (need >= 2)")
    return problems
