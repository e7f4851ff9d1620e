"""The course as the grader reads it: the ground every other part of the grader stands on.

Reading order:

1. :mod:`.labs`: where the course is (``solutions/``, ``labs/``) and a lab by its name or number;
2. :mod:`.cells`: a course notebook's cells as nbgrader marks them (grade ids, solution regions,
   demo cells), notebooks read and written;
3. :mod:`.hidden_tests`: a test cell's two parts, its visible and its hidden tests, and how its points
   are split;
4. :mod:`.config`: the course's nbgrader configuration (:file:`nbgrader_config.py`, also what plain
   ``nbgrader`` reads in a course directory), its cell timeout and due dates; :mod:`.kernel`: the
   pinned ``minidist`` kernel;
5. :mod:`.template`: the private course made from the source labs by ``nbgrader generate_assignment``
   (the release, the template every submission is graded in), nbgrader's converters, a lab's graded
   cells.
"""
