"""What minidist, its checks and the grader agree on, written once (standard library only).

The grader (``autograder/``) and the checks (``minidist/checks/``) talk through environment
variables, file names and a list of answers; the library's own error messages need the same names
to point at a notebook cell. Each of those is defined here and nowhere else. Standard library only
and free of imports: the grader's confirmation processes import it before any student code, and
before torch.

* the environment variables that switch a check's behaviour in the grader;
* the docket: the answers a judged check files, each entry's shape, and the size caps of the
  docket and of the confirmation's wire that carries it (one derived from the other);
* the file names code is compiled under: a notebook cell's (Jupyter's, the confirmation's), and
  the one regular expression that recognises them;
* the prefix of the folders a launch makes in ``$TMPDIR``.
"""
import re

# ----------------------------------------------------------------------------- environment
#: "1": judged checks file their answers in the docket (the confirmation's runner sets it)
DOCKET_ENV = "MINIDIST_DOCKET"
#: "1": graded calls are watched for rebinding what the checks compare with (the confirmation)
GUARD_BINDINGS_ENV = "MINIDIST_GUARD_BINDINGS"
#: seconds: every check's launch timeout (the grader's quick selftest shortens them)
CHECK_TIMEOUT_ENV = "MINIDIST_CHECK_TIMEOUT"
#: a factor on every launch's timeout (the grader's second chance for a test that timed out: x3)
TIMEOUT_SCALE_ENV = "MINIDIST_TIMEOUT_SCALE"
#: a rank's default device ("meta" in the selftest: a tensor made without a device fails)
RANK_DEFAULT_DEVICE_ENV = "MINIDIST_RANK_DEFAULT_DEVICE"
#: HIDDEN_IN_CONFIRMATION in a grading kernel: its ``hidden=True`` calls are scored by the confirmation
#: alone (the kernel has no hidden case tables; :mod:`minidist.checks.kit.withheld`)
HIDDEN_CASES_ENV = "MINIDIST_HIDDEN_CASES"
HIDDEN_IN_CONFIRMATION = "confirmation"

# ----------------------------------------------------------------------------- the docket
#: the module holding the docket, which the confirmation's runner reads after every test
DOCKET_MODULE = "minidist.checks.kit.docket"
#: one test's answers at most (past it, the test cannot be confirmed, and says so)
DOCKET_MAX_BYTES = 6 << 20
#: one message on the confirmation's wire: a test's reply is its docket and a few fields
WIRE_MAX_BYTES = DOCKET_MAX_BYTES + (2 << 20)


def is_docket_entry(entry) -> bool:
    """An entry as a judged check files it: (check's key, its params as JSON, case index, answer as
    plain data bytes). Anything else in the docket is dropped on its way to the judge."""
    return (type(entry) is tuple and len(entry) == 4 and type(entry[0]) is str and type(entry[1]) is str
            and type(entry[2]) is int and type(entry[3]) is bytes)


# ----------------------------------------------------------------------------- notebook cells
#: the confirmation compiles a solution cell as "<solution ID>", the lab's own cells as "<grader ID>"
SOLUTION_PREFIX = "<solution "
GRADER_PREFIX = "<grader "
#: code compiled from a notebook cell: Jupyter's kernel ("/tmp/ipykernel_123/456.py", older IPython's
#: "<ipython-input-...>"), the confirmation's, and a test's "<cell ...>"
NOTEBOOK_CELL = re.compile(r"ipykernel_\d+|<ipython-input|^<solution |^<grader |^<cell")

# ----------------------------------------------------------------------------- launches
#: a launch keeps its ranks' result, status and progress files in tempfile.mkdtemp(prefix=LAUNCH_PREFIX)
LAUNCH_PREFIX = "minidist-"
