"""The worker: one submission graded in a process of its own, under the supervisor's eye.

Reading order:

1. :mod:`.process`: the process (forked from the supervisor's forkserver, in a session of its own,
   talking through a pipe) and what the forkserver imports first;
2. :mod:`.job`: :func:`~.job.run`, the job as its list of steps;
3. the steps: :mod:`.submission` (the job's course, what was handed in made gradable), :mod:`.box`
   (the sandbox's home, the kernel, the confirmation runs), :mod:`.autograde` (nbgrader's ``autograde``
   and ``generate_feedback``);
4. what the steps use: :mod:`.notebooks` (a submitted notebook found, parsed, repaired; a test's
   outcome in a word), :mod:`.flags` (what the source does that a lab never asks for, for the
   instructor), :mod:`.nbext` (the extensions of nbgrader's preprocessors, also named by the course
   configuration for plain nbgrader) and :mod:`.retry` (the second chance: timeouts x 3).
"""
