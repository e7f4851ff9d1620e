"""Grading where classes are graded: every platform grades one submission with the one grading core
(:func:`autograder.grading.batch.grade_one`) and only writes its result in the platform's format.

* ``graded.py``: a platform's submission folder -> the lab's notebook graded, or a clear problem;
  per-test results with each test's visibility (hidden tests) and manual cells marked; the results
  file written last, by the grader's process, whatever the submission left; a failure of the grader
  itself raised (:class:`~autograder.handout.platforms.graded.GraderFailure`), for the platform to report as
  an error, never as a score;
* ``bundle.py``: what a grading machine installs (a minidist wheel, the grader's source and the
  lab's source notebook, pinned requirements, ``setup.sh``);
* ``limits.py``: the platforms' timeouts and the submission's wall-clock limit within them, checked
  when a bundle is built; PrairieLearn's image name;
* ``version.py``: a bundle's record of the course it grades with (``bundle.json``), and what has
  changed since (``--check``);
* ``gradescope.py``: ``LAB_autograder.zip`` and its ``run_autograder`` (``results.json``);
* ``prairielearn.py``: an external-grading question and its grader image (``/grade/results/results.json``);
* ``resources.py``: wall time and peak memory of grading each lab's solution on one CPU.
"""
