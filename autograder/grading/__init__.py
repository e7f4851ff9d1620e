"""Grading: a class's submissions, each graded in a worker of its own, and what ``grade`` writes.

Reading order, from the class down to one submission:

1. :mod:`.grade`: ``python -m autograder grade``: the submissions found, graded a few at a time in one
   batch, stopped cleanly by a signal, then merged and written;
2. :mod:`.batch`: the one grading core: what a batch makes once (the template course, the pristine
   minidist, the sandbox's probe) and :func:`~.batch.grade_submission`, which every submission goes
   through, whoever grades it (``grade``, the selftest, a platform's :func:`~.batch.grade_one`);
3. :mod:`.supervise`: one submission's worker process, started, listened to under the wall-clock limit,
   and every process it started killed afterwards;
4. :mod:`.worker`: inside that process, the job's steps (:mod:`.worker.job`);
5. :mod:`.records`: what the supervisor accepts of a worker's messages, checked, and a submission's
   :class:`~.records.Job`;
6. what the batch writes: :mod:`.gradebook` (nbgrader's gradebooks: due dates, scores, late penalties,
   ``grades.csv``), :mod:`.results` (``results.csv``, ``results.json``, ``batch.json``, the feedback
   pages) and :mod:`.roster` (the class roster ``grade --roster`` checks and stores).

The reports read what a batch wrote (:mod:`autograder.reports`); the sandbox and the confirmation
are packages of their own (:mod:`autograder.sandbox`, :mod:`autograder.confirm`).
"""
