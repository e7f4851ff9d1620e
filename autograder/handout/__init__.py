"""Handing out: what students and grading machines get, made from the course, never its answers.

Reading order:

1. :mod:`.release`: ``python -m autograder release``: ``labs/`` made from ``solutions/`` by nbgrader
   (solutions and hidden tests stripped), and ``--check`` that it is up to date;
2. :mod:`.wheel`: a wheel of the minidist library alone, built offline, less every lab's hidden case
   tables;
3. :mod:`.student_dist`: ``python -m autograder student-dist OUT``: the released labs, that wheel and a
   README, for students;
4. :mod:`.platforms`: Gradescope's and PrairieLearn's packages (the bundle a grading machine installs,
   the lab's grading files without solutions) and the program each runs per submission, which grades
   it with the one grading core (:func:`autograder.grading.batch.grade_one`);
5. :mod:`.scaffold`: ``python -m autograder new-exercise``: the skeleton of one more graded exercise,
   written into the lab's notebook, its checks and its bug bank.
"""
