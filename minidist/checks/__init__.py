"""Checks shared by ``tests/``, the lab notebooks and the autograder: one module per lab.

* ``common``: timeouts, tolerance, and ``launch_named`` (launch, name the failing case);
* ``collectives``: any collective against torch, and its traced pattern;
* ``training``: a student's data-parallel code trained by the one loop, vs one process;
* ``groups``: cases on groups of t ranks inside one launch (labs 5, 6, 8, 9);
* ``refusal``: minidist's own implementation refused while a graded function runs, and
  ``bindings``: what graded code must leave bound as it found it (the checks, torch's comparisons);
* ``lab1_collectives`` ... ``lab9_expert_parallel`` (one per lab, named like its notebook):
  each lab's graded checks, with their case runners in ``labN_cases`` and their references
  in ``labN_reference`` where a lab has them. A lab imports its own as ``checks``::

      from minidist.checks import lab1_collectives as checks
      checks.check_function("ring_all_reduce", ring_all_reduce)
"""
