"""Checks shared by ``tests/``, the lab notebooks and the autograder: one module per lab.

* ``common``: timeouts, tolerance, and ``launch_named`` (launch, name the failing case);
* ``collectives``: any collective against torch, and its traced pattern;
* ``training``: a student's data-parallel code trained by the one loop, vs one process;
* ``lab1_collectives``, ``lab2_data_parallel``, ``lab3_zero_fsdp``, ``lab4_pipeline``,
  ``lab5_tensor_parallel``:
  each lab's graded checks. A lab imports its own as ``checks``::

      from minidist.checks import lab1_collectives as checks
      checks.check_function("ring_all_reduce", ring_all_reduce)
"""
