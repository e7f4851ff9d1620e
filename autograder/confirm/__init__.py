"""The confirmation: every graded test again, in a new interpreter outside the student's kernel.

nbgrader runs a submission in a kernel where student code and tests share one process, so a cell
can replace the checks, ``torch.allclose`` or the guard. The confirmation run starts from an
interpreter that has imported torch and the pristine minidist and nothing else, lets the lab's own setup cells bind pristine minidist checks and torch, and only then
loads student code, and only as the source of the submission's solution cells; the test cells (with
their hidden tests) come from the instructor's source notebook. Every test the child reports passed
is judged again by a process that never ran student code.

One concept a file. In the grader: :mod:`.start` (what a confirmation runs, and starting one in the
sandbox) and :mod:`.points` (the confirmation's points, and the one rule that combines them with
the notebook's: a test keeps its notebook points only as far as the confirmation gives them). In the
sandbox, standard library and minidist only, copied next to the pristine minidist:
:mod:`.parent` (writes the verdict, never runs student code), :mod:`.runner` (the child that runs
the cells), :mod:`.judge` (gives every verdict again), :mod:`.warm` (the parent imports torch once and
forks the judge and the child from itself, before it reads the run's spec), :mod:`.audit` (the child's
audit hook), :mod:`.wire` (their messages) and :mod:`.handed_in` (files handed in next to the notebook, which a
sandboxed kernel loads too).
"""
