"""The labs' checks, used alike by the lab notebooks' test cells, by ``tests/`` and by the grader.

* ``kit/``: the grading kit, written once: a :class:`~minidist.checks.kit.check.Check` and the lab's
  registry of them (``check.py``), running one (``run.py``: the guard around the answers, the docket
  filing, the verdict), the one comparison (``compare.py``), launching (``launch.py``) and groups of
  ranks (``groups.py``), the guard's parts (``refusal.py``, ``threads.py``, ``bindings.py``,
  ``returned.py``, ``student_code.py``, ``quiet.py``), stand-ins (``stand_ins.py``), the docket
  (``docket.py``), the must-raise rule (``raises.py``), two shared kinds of check (``collectives.py``,
  ``training.py``), and where a lab's hidden cases come from (``withheld.py``);
* a folder per lab, named like its notebook (``lab1_collectives`` ... ``lab11_overlap``, and
  ``toylab``, the grader's test fixture and docs/AUTHORING.md's worked example): ``__init__.py``
  (``REFUSED``, the registry ``CHECKS`` and the public checks), an exercise's cases and verdict in a
  module of its own (the toy lab's ``add.py``), or, where exercises share code, ``cases.py``,
  ``answers.py`` (the only file that calls student code) and ``verdicts.py`` (never reads ``answers``);
  ``demo.py`` where the notebook plots measurements, and ``hidden.py``: the hidden cases, the
  grader's alone (left out of the student wheel, ``python -m autograder student-dist``). A notebook
  imports its lab's as ``checks`` and calls ``check_<function>`` (and ``check_device``)::

      from minidist.checks import lab1_collectives as checks
      checks.check_ring_all_reduce(ring_all_reduce)
      checks.check_device(ring_all_reduce)
"""
