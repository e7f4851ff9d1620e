"""``python -m autograder similarity OUT`` on a graded batch's output laid out by hand (no grading):
OUT/autograded/<student>/<lab>/<lab>.ipynb is the release with one answer cell filled in (four for two
students), results.csv
and grades.csv as ``grade`` writes them.

* a renamed copy of minidist's ring all-reduce (its helpers inlined, every variable and helper renamed,
  no docstring, comments of its own) is flagged against the library, and so is a renamed copy of a helper
  the checks ship (``minidist/checks/<lab>/``: the library is the whole installed package);
* two students sharing one answer, one of them with renamed variables and comments, are flagged as a pair;
  two sharing three answers and not a fourth are one entry with all four cells and their scores;
* a pair whose highest cell is below the threshold, from the near-miss level, is listed after the
  flagged ones and not flagged;
* the bank's correct alternatives that solve a function another way (written in full, ``code=``) are not
  flagged against each other, nor against the solution, at the chosen threshold;
* nothing but results.csv's ``similarity`` column changes: no score, no other file;
* answer cells left as released are not compared: they would all match.
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

from autograder.course.cells import grade_id, nbg, read_nb, strip_solution_markers, write_nb
from autograder.grading.results import RESULT_FIELDS
from autograder.selftest.bank import load_bank

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


def checks_verdict_copy() -> str:
    """A helper the checks ship (lab 5's verdict of its sequence-parallel functions, in
    ``minidist/checks/``, which no lab refuses), pasted into the sp_gather cell and renamed (but for the
    function's name, which the tests call)."""
    from minidist.checks.lab5_tensor_parallel import verdicts
    source = inspect.getsource(verdicts.sp).replace("def sp(", "def sp_gather(", 1)
    return "# my sequence-parallel gather\n" + renamed(source, keep={"sp_gather"})


#: two students who share three answers of lab 1 (one of them renamed) and wrote a fourth each their own way
SHARED = ("sendrecv", "ring_reduce_scatter", "recursive_halving_all_reduce")
OWN = {"dan": "naive_irecv_all_then_sum", "erin": "naive_inline_broadcast"}


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
    students["frank"] = (LAB5, "sp_gather", checks_verdict_copy())
    answers = {s: {cell: code} for s, (lab, cell, code) in students.items()}
    for s, alternative in OWN.items():
        students[s] = (LAB1, "naive_all_reduce", bank_code(LAB1, alternative))
        answers[s] = {"naive_all_reduce": bank_code(LAB1, alternative)}
        answers[s].update({c: solution[LAB1][c] if s == "dan" else renamed(solution[LAB1][c], keep={c})
                           for c in SHARED})
    rows = []
    for student, (lab, _, _) in students.items():
        nb = copy.deepcopy(release[lab])        # the other answer cells as released: never compared
        for cell, code in answers[student].items():
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
    from autograder.reports.similarity_report import report
    r = report(out)
    return {"out": out, "before": before, "pairs": r["pairs"], "students": students, "answers": answers,
            "rows": list(csv.DictReader(open(out / "results.csv"))), "old_rows": rows}


def pairs_of(batch, a, b) -> list:
    return [p for p in batch["pairs"] if {p.a, p.b} == {a, b}]


def flagged(batch, a, b) -> list:
    return [p for p in pairs_of(batch, a, b) if p.flagged]


def test_renamed_copy_of_the_library_ring_is_flagged(batch):
    from autograder.reports.similarity import THRESHOLD
    answer = batch["students"]["alice"][2]
    assert "my_" in answer and not re.search(r"\b(acc|me|exchange|chunks)\b", answer)      # it was renamed
    hits = flagged(batch, "alice", "minidist")
    assert len(hits) == 1 and hits[0].library and hits[0].score >= THRESHOLD, [(p.a, p.b, p.score) for p in batch["pairs"]]
    from autograder.reports.similarity_report import other_name
    assert "ring_reduce_scatter_into" in other_name(hits[0].matches[0])
    row = next(r for r in batch["rows"] if r["student"] == "alice" and r["cell"] == "test_ring_all_reduce_correct")
    assert row["similarity"].startswith(f"{hits[0].score:.2f} with minidist (")
    html = (batch["out"] / "similarity.html").read_text()
    section = html[html.index(">alice and minidist"):]
    assert "the lab's own solution against minidist" in section
    own = re.search(r"<td class='own'>([0-9.]+)</td>", section)
    assert own and float(own.group(1)) < THRESHOLD           # the lab's own solution is no library copy


def test_a_renamed_copy_of_a_function_the_checks_ship_is_flagged(batch):
    """The library is all of the installed package: a helper of ``minidist/checks/<lab>/`` (which no lab
    refuses) pasted into an answer and renamed is flagged against minidist, and named."""
    from autograder.reports.similarity_report import other_name
    answer = batch["students"]["frank"][2]
    assert "my_" in answer and "def sp(" not in answer
    hits = flagged(batch, "frank", "minidist")
    assert len(hits) == 1 and hits[0].score >= 0.9, [(p.a, p.b, p.score) for p in batch["pairs"]]
    assert "minidist/checks/lab5_tensor_parallel/verdicts.py: sp" in other_name(hits[0].matches[0])
    rows = [r for r in batch["rows"] if r["student"] == "frank" and r["similarity"]]
    assert rows and all("with minidist (minidist/checks/lab5_tensor_parallel/verdicts.py: sp" in r["similarity"]
                        for r in rows)


def test_two_students_sharing_one_answer_are_flagged(batch):
    assert batch["students"]["carol"][2] != batch["students"]["bob"][2]
    pair = flagged(batch, "bob", "carol")
    assert len(pair) == 1 and pair[0].score >= 0.95
    by = {(r["student"], r["cell"]): r["similarity"] for r in batch["rows"]}
    assert "with carol (ring_all_reduce)" in by[("bob", "test_ring_all_reduce_pattern")]
    assert "with bob (ring_all_reduce)" in by[("carol", "test_ring_all_reduce_correct")]
    assert by[("bob", "test_broadcast_correct")] == ""            # a test of another function: no flag
    html = (batch["out"] / "similarity.html").read_text()
    assert "<mark>" in html and html.index("bob and carol") < html.index("</table>")


def test_one_entry_per_pair_with_every_cell_they_share(batch):
    """dan and erin share three answers (erin's renamed) and wrote naive_all_reduce each their own way:
    one entry, flagged, listing all four cells with their scores, highest first; only the cells from
    the threshold fill results.csv's column."""
    from autograder.reports.similarity import THRESHOLD
    entries = pairs_of(batch, "dan", "erin")
    assert len(entries) == 1 and entries[0].flagged
    cells = [m.a.cell for m in entries[0].matches]
    assert sorted(cells) == sorted(SHARED + ("naive_all_reduce",))
    scores = [m.score for m in entries[0].matches]
    assert scores == sorted(scores, reverse=True) and entries[0].score == scores[0] >= 0.9
    own = next(m for m in entries[0].matches if m.a.cell == "naive_all_reduce")
    assert own.score < THRESHOLD                   # listed with its score, not flagged
    by = {(r["student"], r["cell"]): r["similarity"] for r in batch["rows"]}
    checked = set()
    for m in entries[0].matches:      # the cells that a test of their own calls (sendrecv has none)
        for t in (c for (s, c) in by if s == "erin" and c.startswith(f"test_{m.a.cell}_")):
            assert ("with dan" in by[("erin", t)]) == (m.score >= THRESHOLD), (m.a.cell, m.score, t)
            checked.add(m.a.cell)
    assert checked == {"ring_reduce_scatter", "recursive_halving_all_reduce", "naive_all_reduce"}
    html = (batch["out"] / "similarity.html").read_text()
    assert html.count("dan and erin") == 2          # one row in the list, one section: one entry


def test_near_misses_are_listed_below_the_flagged_pairs_not_flagged(batch, tmp_path):
    """The lab's own reduce_from_tp scores 0.64 against minidist: from NEAR_MISS it is listed after every
    flagged pair, marked as not flagged, and fills no column; a higher --near-miss leaves it out."""
    import shutil
    from autograder.reports.similarity import NEAR_MISS, THRESHOLD
    from autograder.reports.similarity_report import report
    near = [p for p in batch["pairs"] if not p.flagged]
    assert near and all(NEAR_MISS <= p.score < THRESHOLD for p in near)
    assert [p.flagged for p in batch["pairs"]] == sorted((p.flagged for p in batch["pairs"]), reverse=True)
    miss = pairs_of(batch, "sol_reduce_from_tp", "minidist")
    assert len(miss) == 1 and not miss[0].flagged
    assert not [r for r in batch["rows"] if r["student"] == "sol_reduce_from_tp" and r["similarity"]]
    html = (batch["out"] / "similarity.html").read_text()
    heading = re.search(r"<h2 id='p\d+'[^>]*>\d+\. sol_reduce_from_tp and minidist: ([0-9.]+) \(near miss, not "
                        r"flagged\)</h2>", html)
    assert heading and float(heading.group(1)) == round(miss[0].score, 2)
    assert all(html.index(f"{p.a} and {p.b}: ") < heading.start() for p in batch["pairs"] if p.flagged)
    assert html.index("Near misses") < html.index(">sol_reduce_from_tp and minidist</td>")
    other = tmp_path / "out"
    shutil.copytree(batch["out"], other)
    r = report(other, near_miss=round(miss[0].score, 2) + 0.01)
    assert [p.b for p in r["pairs"] if p.a == "sol_reduce_from_tp"] == []
    assert [(p.a, p.b) for p in r["pairs"] if p.flagged] == [(p.a, p.b) for p in batch["pairs"] if p.flagged]
    with pytest.raises(SystemExit, match="near-miss"):
        report(other, near_miss=0.9)


def test_independent_correct_alternatives_are_not_flagged(batch):
    for (lab, cell), names in INDEPENDENT.items():
        for a, b in itertools.combinations([holder(cell)] + names, 2):
            assert not flagged(batch, a, b), (cell, a, b, [p.score for p in flagged(batch, a, b)])
        for name in names:        # nor are they taken for the library's
            assert not flagged(batch, name, "minidist"), name
    flagged_rows = {r["student"] for r in batch["rows"] if r["similarity"]}
    assert flagged_rows <= {"alice", "bob", "carol", "dan", "erin", "frank"} | {holder(cell) for _, cell in INDEPENDENT}


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
    assert "bob and carol" in printed and "dan and erin" in printed and "no score changed" in printed
    assert re.search(r"sol_reduce_from_tp and minidist .*near miss, not flagged", printed)
    assert "pairs flagged (a cell at or above 0.8): 4;" in printed and "near misses from 0.6, not flagged: 1" in printed


def test_report_escapes_names_and_code(tmp_path):
    from autograder.reports.similarity import Match, Pair, Text
    from autograder.reports.similarity_report import write_html
    evil = Text("<script>x</script>", LAB1, LAB1, "<i>cell</i>", "def f():\n    return '<b>' </i>\n")
    other = Text("<b>bob</b>", LAB1, LAB1, "<i>cell</i>", evil.source)
    write_html(tmp_path / "s.html", [Pair(evil.who, other.who, [Match(1.0, evil, other, ((), ()))])], [evil, other],
               tmp_path)
    text = (tmp_path / "s.html").read_text()
    assert "<script>" not in text and "&lt;script&gt;" in text and "'&lt;b&gt;' &lt;/i&gt;" in text.replace("&#x27;", "'")
    assert "<b>bob</b>" not in text and "&lt;b&gt;bob&lt;/b&gt;" in text and "<i>cell</i>" not in text


def test_the_release_is_read_from_the_batch_s_gradebook_read_only(tmp_path, monkeypatch):
    """The cells as released come from OUT/gradebook.db (what the batch was graded against), opened
    read-only; without one, from labs/."""
    import nbgrader.api
    from nbgrader.api import Gradebook
    from autograder.course import template
    from autograder.reports.similarity import release_cells
    monkeypatch.setattr(nbgrader.api, "get_alembic_version", template._alembic_head)   # as build_course does
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
