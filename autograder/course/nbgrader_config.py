"""nbgrader course configuration for minidist.

The source notebooks live in ``solutions/<lab>/<lab>.ipynb`` and the student
release is generated into ``labs/<lab>/``.  ``python -m autograder`` loads this
file and, for grading, points ``CourseDirectory.root`` at a private temporary
course directory per submission (see autograder/README.md).
"""
import os

c = get_config()  # noqa: F821  (provided by traitlets when this file is loaded)

# this file is autograder/course/nbgrader_config.py: the repository is three folders up
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

c.CourseDirectory.course_id = "minidist"
c.CourseDirectory.root = _REPO
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"
# nbgrader copies every other file of a lab's source folder into its release (and into the folder a
# submission is graded in): never a lab's bug bank, solutions/<lab>/bugbank.py (nbgrader's defaults,
# then the bank)
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "bugbank.py"]
# the gradebook is never written into the repository: every command overrides
# this with a database in its own temporary or output directory
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(_REPO, "out", "gradebook.db")

# Release: stubs students see in place of the solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# Grading kernel: pinned, has minidist installed (python -m autograder installs it
# on first use: python -m ipykernel install --sys-prefix --name minidist).
c.Execute.kernel_name = "minidist"
# Per-cell timeout (nbgrader's default is 30 s).  Tests call minidist.launch with
# timeouts of at most ~30 s, so a cell that deadlocks is reported by LaunchError
# well before this fires; this only catches code that never returns at all.
c.Execute.timeout = 120
# Rank subprocesses write straight to file descriptor 2; do not turn that into
# "stderr" cell output (nbgrader scores any stderr output in a test cell as 0).
c.Execute.extra_arguments = [
    "--HistoryManager.hist_file=:memory:",
    "--IPKernelApp.capture_fd_output=False",
]
# Deleted grade/test cells are put back (the autograder also restores them
# itself before nbgrader runs, and records that it did).
c.OverwriteCells.add_missing_cells = True
# Due dates per lab (ISO 8601 with a time zone, e.g. "2025-03-14 23:59:00 +0100"); a lab
# without one has no due date. `python -m autograder grade --due LAB=DATE` overrides them.
# A submission's time is its timestamp.txt (nbgrader's submitted layout).
c.Minidist.due_dates = {}
# Late penalties, through nbgrader's late-submission plugin (AssignLatePenalties): "none",
# "zero" (nbgrader's), or "per_day": LatePenalty.per_day of the score per started day late,
# at most LatePenalty.max_fraction of it.
c.AssignLatePenalties.plugin_class = "autograder.grading.worker.nbext.LatePenalty"
c.LatePenalty.penalty_method = "per_day"
c.LatePenalty.per_day = 0.1
c.LatePenalty.max_fraction = 1.0
# Megabytes of output: keep the autograded notebooks and feedback small.
c.LimitOutput.max_lines = 200
c.LimitOutput.max_traceback = 60

# Plain nbgrader in a course directory (JupyterHub, formgrader; autograder/README.md, "With nbgrader"):
# `nbgrader autograde` does not run the cells a lab tags "demo", and `nbgrader generate_feedback`
# shows no hidden-test source (a test cell's hidden block and its tracebacks are cut). `python -m
# autograder` sets its own preprocessors for both, so these lines change nothing of its grading.
c.Autograde.autograde_preprocessors = [
    "autograder.grading.worker.nbext.SkipDemoCells", "nbgrader.preprocessors.Execute",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor", "nbgrader.preprocessors.LimitOutput",
    "autograder.grading.worker.nbext.TruncateOutput", "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties", "nbgrader.preprocessors.CheckCellMetadata"]
c.GenerateFeedback.preprocessors = [
    "autograder.grading.worker.nbext.HideHiddenTests", "autograder.grading.worker.nbext.TruncateOutput",
    "nbgrader.preprocessors.GetGrades", "nbconvert.preprocessors.CSSHTMLHeaderPreprocessor"]
