"""Reports: what an instructor does with a graded batch (the folder ``grade`` wrote) after grading.

Reading order:

1. :mod:`.feedback`: ``python -m autograder feedback OUT``: every feedback page checked for hidden-test
   source, and the clean ones copied per student for handing back;
2. :mod:`.export`: ``python -m autograder export OUT``: the batch's grades as the file an LMS imports
   (nbgrader's CSV, Canvas, Moodle), with the class roster;
3. :mod:`.similarity`: ``python -m autograder similarity OUT``: which answers look copied, from the
   library (:mod:`.similarity_library`: everything the course ships) or from a classmate, by pair;
   :mod:`.similarity_report` writes ``similarity.html`` and ``results.csv``'s column.

None of them changes a score: flags and files for a person to read.
"""
