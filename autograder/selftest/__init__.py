"""The selftest: the grader and every lab's tests checked against the lab's bug bank, and the bench.

Reading order:

1. :mod:`.selftest`: ``python -m autograder selftest``: per lab, in one batch, the solution (full marks),
   the release (0, no timeout), every bug of the bank (loses points on each test it names) and every
   correct alternative (full marks); ``--quick`` grades the solution and checks the rest in kernels;
2. :mod:`.bank`: a lab's bug bank (``solutions/<lab>/bugbank.py``), loaded, held to its rules, and one
   entry injected into the solution;
3. :mod:`.bugcheck`: the quick selftest's kernels, into which the bank's entries are swapped one at a
   time;
4. :mod:`.bench`: ``python -m autograder bench``: how long grading takes here, with and without the
   confirmation and the sandbox, and with one or two jobs.
"""
