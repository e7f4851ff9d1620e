"""``python -m autograder COMMAND``: one module per command, each building its own sub-parser (``add``)
and running it (``run``); :mod:`autograder.__main__` dispatches.

Reading order, as a course goes: :mod:`.release` and :mod:`.student_dist` (what students get);
:mod:`.grade`, then :mod:`.similarity`, :mod:`.feedback` and :mod:`.export` (a class graded, and what
follows); :mod:`.gradescope`, :mod:`.prairielearn` and :mod:`.resources` (grading on a platform);
:mod:`.selftest` and :mod:`.bench` (the grader checked and measured); :mod:`.new_exercise` (writing a
lab); :mod:`.doctor` (this machine's sandbox). :mod:`.common`: what several of them share.
"""
