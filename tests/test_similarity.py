"""``python -m autograder similarity OUT`` on a graded batch's output laid out by hand (no grading):
OUT/autograded/<student>/<lab>/<lab>.ipynb is the release with one answer cell filled in, results.csv
and grades.csv as ``grade`` writes them.

* a renamed copy of minidist's ring all-reduce (its helpers inlined, every variable and helper renamed,
  no docstring, comments of its own) is flagged against the library;
* two students sharing one answer, one of them with renamed variables and comments, are flagged as a pair;
* the bank's correct alternatives that solve a function another way (written in full, ``code=``) are not
  flagged against each other, nor against the solution, at the chosen threshold;
* nothing but results.csv's ``similarity`` column changes: no score, no other file;
* answer cells left as released (every student's but one here) are not compared: they would all match.
"""
from __future__ import annotations

import ast
import copy
import csv
import hashlib
import inspect
import itertools
import re
import textwrap
from pathlib import Path

import pytest

from autograder.course import grade_id, nbg, read_nb, strip_solution_markers, write_nb
from autograder.report import RESULT_FIELDS
from autograder.selftest import load_bank

REPO = Path(__file__).resolve().parent.parent
LAB1, LAB5 = "lab1_collectives", "lab5_tensor_parallel"

#: correct alternatives of the bank written in full that solve the function another way than the
#: solution and than each other (alternatives that rewrite a line or two of the solution share its text)
INDEPENDENT = {
    (LAB1, "broadcast"): ["broadcast_binomial_tree", "broadcast_binomial_doubling_rounds",
                          "broadcast_root_blocking_sends", "broadcast_chain"],
    (LAB1, "ring_all_reduce"): ["ring_reuses_own_reduce_scatter", "ring_list_chunks_and_cat"],
    (LAB5, "copy_to_tp"): ["f_as_a_gradient_hook"],
    (LAB5, "reduce_from_tp"): ["g_functional_all_reduce", "g_detached_sum_plus_zero"],
}


def renamed(source: str, keep=frozenset()) -> str:
    """``source`` as a student who copied it hands it in: every name it binds (arguments, variables,
    functions, except ``keep``) renamed wherever it is used, decorators and docstrings gone, its
    comments replaced by comments of their own; the layout kept (renaming by hand keeps it)."""
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    bound = {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    bound |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    names = {old: f"my_{old.strip('_')}_{i}" for i, old in enumerate(sorted(bound - set(keep)))}
    lines = source.split("\n")
    edits, drop = {}, set()           # {(line, column): (old, new)}; lines of docstrings and decorators
    for node in ast.walk(tree):
        name = node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg) else None
        if name in names:
            edits[(node.lineno, node.col_offset)] = (name, names[name])
        if isinstance(node, ast.FunctionDef):
            if node.name in names:
                col = lines[node.lineno - 1].index(f"def {node.name}") + 4
                edits[(node.lineno, col)] = (node.name, names[node.name])
            drop |= {n for d in node.decorator_list for n in range(d.lineno, d.end_lineno + 1)}
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(node.body) > 1:
                drop |= set(range(first.lineno, first.end_lineno + 1))
    for (no, col), (old, new) in sorted(edits.items(), reverse=True):
        line = lines[no - 1]
        lines[no - 1] = line[:col] + new + line[col + len(old):]
    out = []
    for no, line in enumerate(lines, 1):
        if no in drop:
            continue
        line = re.sub(r"\s+#.*$", "", line)                             # their comments go
        if line.strip().startswith(("for ", "while ")):
            line += "  # go round the ring"
        out.append(line)
    return "\n".join(out)


def library_ring_copy() -> str:
    """minidist's ring all-reduce and the helpers it calls, copied into one cell and renamed."""
    from minidist.collectives import allreduce, p2p, primitives
    functions = [p2p.group_info, p2p.global_rank, p2p.send_to, p2p.recv_from, p2p.wait_all, p2p.post_exchange, p2p.exchange,
                 p2p.chunks, allreduce._prepare, primitives.ring_reduce_scatter_into,
                 primitives.ring_all_gather_into, allreduce.ring_all_reduce]
    source = "\n\n".join(textwrap.dedent(inspect.getsource(inspect.unwrap(f))) for f in functions)
    return "# ring all-reduce: my own version\n" + renamed(source.replace("check_tensor(tensor)", "pass"),
                                                           keep={"ring_all_reduce"})


def holder(cell: str) -> str:
    """The student who hands in the solution's answer to ``cell`` (bob's is lab 1's ring all-reduce)."""
    return "bob" if cell == "ring_all_reduce" else f"sol_{cell}"


def bank_code(lab: str, name: str) -> str:
    return next(a for a in load_bank(lab)["ALTERNATIVES"] if a["name"] == name)["code"].strip("\n")


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """OUT with one notebook per student; every answer cell the release's stub but the one named."""
    out = tmp_path_factory.mktemp("graded")
    source = {lab: read_nb(REPO / "solutions" / lab / f"{lab}.ipynb") for lab in (LAB1, LAB5)}
    release = {lab: read_nb(REPO / "labs" / lab / f"{lab}.ipynb") for lab in (LAB1, LAB5)}
    solution = {lab: {grade_id(c): strip_solution_markers(c.source) for c in source[lab].cells
                      if nbg(c).get("solution")} for lab in source}
    ring = solution[LAB1]["ring_all_reduce"]
    students = {"alice": (LAB1, "ring_all_reduce", library_ring_copy()),
                "bob": (LAB1, "ring_all_reduce", ring),
                "carol": (LAB1, "ring_all_reduce", renamed(ring, keep={"ring_all_reduce"}))}
    for (lab, cell), names in INDEPENDENT.items():
        if holder(cell) not in students:
            students[holder(cell)] = (lab, cell, solution[lab][cell])
        students.update({name: (lab, cell, bank_code(lab, name)) for name in names})
    rows = []
    for student, (lab, cell, code) in students.items():
        nb = copy.deepcopy(release[lab])        # the other answer cells as released: never compared
        next(c for c in nb.cells if grade_id(c) == cell).source = code
        write_nb(nb, out / "autograded" / student / lab / f"{lab}.ipynb")
        for k, c in enumerate(c for c in nb.cells if nbg(c).get("grade")):
            rows.append({"student": student, "lab": lab, "notebook": lab, "cell": grade_id(c),
                         "points": float(k % 3), "max_points": 2.0, "status": "fail", "reason": "r",
                         "flags": "", "confirmed": "", "similarity": ""})
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        w.writeheader()
        w.writerows(rows)
    (out / "grades.csv").write_text("assignment,student_id,score\n" + "".join(
        f"{lab},{s},1.0\n" for s, (lab, _, _) in students.items()))
    (out / "gradebook.db").write_bytes(b"not touched")
    before = {p.relative_to(out): hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    from autograder.similarity_report import report
    r = report(out)
    return {"out": out, "before": before, "pairs": r["pairs"], "students": students,
            "rows": list(csv.DictReader(open(out / "results.csv"))), "old_rows": rows}


def flagged(batch, a, b) -> list:
    return [p for p in batch["pairs"] if {p.a.who, p.b.who} == {a, b}]


def test_renamed_copy_of_the_library_ring_is_flagged(batch):
    from autograder.similarity import THRESHOLD
    answer = batch["students"]["alice"][2]
    assert "my_" in answer and not re.search(r"\b(acc|me|exchange|chunks)\b", answer)      # it was renamed
    hits = [p for p in batch["pairs"] if p.a.who == "alice" and p.b.library]
    assert hits and hits[0].score >= THRESHOLD, [(p.a.who, p.b.who, p.score) for p in batch["pairs"]]
    from autograder.similarity_report import other_name
    assert "ring_reduce_scatter_into" in other_name(hits[0])
    row = next(r for r in batch["rows"] if r["student"] == "alice" and r["cell"] == "test_ring_all_reduce_correct")
    assert row["similarity"].startswith(f"{hits[0].score:.2f} with minidist (")
    html = (batch["out"] / "similarity.html").read_text()
    own = re.search(r"The lab's own solution to this cell scores ([0-9.]+) against the library", html)
    assert own and float(own.group(1)) < THRESHOLD           # the solution itself is no library copy


def test_two_students_sharing_one_answer_are_flagged(batch):
    assert batch["students"]["carol"][2] != batch["students"]["bob"][2]
    pair = flagged(batch, "bob", "carol")
    assert len(pair) == 1 and pair[0].score >= 0.95
    by = {(r["student"], r["cell"]): r["similarity"] for r in batch["rows"]}
    assert "with carol (ring_all_reduce)" in by[("bob", "test_ring_all_reduce_pattern")]
    assert "with bob (ring_all_reduce)" in by[("carol", "test_ring_all_reduce_correct")]
    assert by[("bob", "test_broadcast_correct")] == ""            # a test of another function: no flag
    html = (batch["out"] / "similarity.html").read_text()
    assert "<mark>" in html and html.index("bob") < html.index("</table>")


def test_independent_correct_alternatives_are_not_flagged(batch):
    for (lab, cell), names in INDEPENDENT.items():
        for a, b in itertools.combinations([holder(cell)] + names, 2):
            assert not flagged(batch, a, b), (cell, a, b, [p.score for p in flagged(batch, a, b)])
        for name in names:        # nor are they taken for the library's
            assert not [p for p in batch["pairs"] if p.a.who == name and p.b.library], name
    flagged_rows = {r["student"] for r in batch["rows"] if r["similarity"]}
    assert flagged_rows <= {"alice", "bob", "carol"} | {holder(cell) for _, cell in INDEPENDENT}


def test_only_the_similarity_column_changes(batch):
    out = batch["out"]
    after = {p.relative_to(out): hashlib.sha256(p.read_bytes()).hexdigest() for p in out.rglob("*") if p.is_file()}
    changed = {p for p in after if batch["before"].get(p) != after[p]}
    assert changed == {Path("results.csv"), Path("similarity.html")}
    assert len(batch["rows"]) == len(batch["old_rows"])
    for new, old in zip(batch["rows"], batch["old_rows"]):
        assert {k: v for k, v in new.items() if k != "similarity"} == {k: str(v) for k, v in old.items()
                                                                        if k != "similarity"}
    assert any(r["similarity"] for r in batch["rows"])


def test_the_command_gives_the_same_column_again(batch, capsys):
    from autograder.__main__ import main
    assert main(["similarity", str(batch["out"])]) == 0
    assert list(csv.DictReader(open(batch["out"] / "results.csv"))) == batch["rows"]
    printed = capsys.readouterr().out
    assert "bob" in printed and "carol" in printed and "no score changed" in printed


def test_report_escapes_names_and_code(tmp_path):
    from autograder.similarity import Pair, Text
    from autograder.similarity_report import write_html
    evil = Text("<script>x</script>", LAB1, LAB1, "ring_all_reduce", "def f():\n    return '<b>' </i>\n")
    write_html(tmp_path / "s.html", [Pair(1.0, evil, evil, ((), ()))], [evil], tmp_path)
    text = (tmp_path / "s.html").read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text and "'&lt;b&gt;' &lt;/i&gt;" in text.replace("&#x27;", "'")


def test_the_release_is_read_from_the_batch_s_gradebook_read_only(tmp_path, monkeypatch):
    """The cells as released come from OUT/gradebook.db (what the batch was graded against), opened
    read-only; without one, from labs/."""
    import nbgrader.api
    from nbgrader.api import Gradebook
    from autograder import course
    from autograder.similarity import release_cells
    monkeypatch.setattr(nbgrader.api, "get_alembic_version", course._alembic_head)   # as build_course does
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        gb.add_assignment(LAB1)
        gb.add_notebook(LAB1, LAB1)
        gb.add_source_cell("ring_all_reduce", LAB1, LAB1, cell_type="code", locked=False,
                           source="def ring_all_reduce(t):\n    raise NotImplementedError()  # as graded")
    before = (tmp_path / "gradebook.db").read_bytes()
    assert release_cells(tmp_path, LAB1, LAB1) == {"ring_all_reduce": "def ring_all_reduce(t):\n    raise "
                                                                     "NotImplementedError()  # as graded"}
    assert (tmp_path / "gradebook.db").read_bytes() == before
    from_labs = release_cells(tmp_path / "elsewhere", LAB1, LAB1)
    assert "YOUR CODE HERE" in from_labs["ring_all_reduce"]
