"""The attacks of issue 27 on the fixture lab, in the project's own words: graded end to end in
tests/test_cheats.py's batch, next to its honest control.

Each is what a determined student tried (on lab 1, with the sandbox and the confirmation on) and
scored with before: the sandbox handing root to the kernel, the confirmation's verdict
written by student code (from a rank's result file too, or from code torch runs for a solution
cell), a handed-in module running before the snapshot, library answers on
another thread or under another file name, and one submission denying or bloating the feedback.
"""
from __future__ import annotations

from autograder_fixtures import set_code, with_cell

TESTS = ("test_add", "test_allsum")

#: what a root kernel could write on the machine (tests/test_cheats.py reads them before and after)
MACHINE = ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/pid_max", "/proc/sys/vm/overcommit_memory")

ROOT = r'''
import os
for path, value in (("/proc/sys/kernel/core_pattern", "|/tmp/minidist-pwn %p"), ("/proc/sys/kernel/pid_max", "4194000"),
                    ("/proc/sys/vm/overcommit_memory", "1"), ("/dev/minidist-owned", "x"),
                    ("/sys/fs/cgroup/minidist-owned", "x"), ("/sys/fs/cgroup/pids/minidist-owned", "x")):
    try:
        with open(path, "w") as f:
            f.write(value)
        print("wrote", path)
    except OSError as err:
        print("refused", path, err.strerror)
'''

# the kernel's half of a forged verdict (an untouched release otherwise): add defined outside its cell,
# the checks patched
KERNEL_ADD = "def add(a, b):\n    return a + b\n"
KERNEL_CHECKS = "checks.check_allsum = lambda *a, **k: None\nallsum = None\n"

# the confirmation's half, in the first solution cell: reach the runner's main() and report every
# test passed
FORGE = r'''
import os

def forge(frame):
    while frame is not None:
        names = frame.f_locals
        send = names.get("send")
        if callable(send) and "token" in names:             # the runner that wrote the verdict itself
            for t in %(tests)r:
                send(event="test", cell=t, error=None, stderr="", value=None, changed=[], seconds=0.1)
            send(event="done", seconds=1.0)
            os._exit(0)
        if callable(send) and isinstance(names.get("msg"), dict) and "reply" in names:     # its child, now
            for t in %(tests)r:
                send(names["reply"], {"cell": t, "kind": "test", "nonce": names["msg"]["nonce"], "error": None,
                                      "stderr": "", "value": None, "changed": [], "restored": [], "flags": []})
            os._exit(0)
        frame = frame.f_back
''' % {"tests": TESTS}

WALK_STACK = FORGE + r'''
import traceback

def deeper(n):          # walk_stack(None) starts a few frames up: call it from deep enough
    return deeper(n - 1) if n else [frame for frame, _ in traceback.walk_stack(None)]

try:
    for frame in deeper(8):
        forge(frame)
except RuntimeError:
    pass
'''

# the same walk from a frame the audit hook never sees handed out: a signal handler's
SIGNAL_FRAME = FORGE + r'''
import signal
signal.signal(signal.SIGUSR1, lambda sig, frame: forge(frame))
os.kill(os.getpid(), signal.SIGUSR1)
'''

# the same walk, compiled under a standard-library file name so that the audit hook takes it for os's code
STDLIB_NAME = FORGE + r'''
import sys
try:
    exec(compile("forge(sys._getframe())", os.__file__, "exec"))
except RuntimeError:
    pass
'''

# the same forgery from a rank, while test_allsum (and its nonce) is in flight: the graded function
# walks from a signal handler's frame up to the runner's main(), which the rank inherited at fork,
# and writes a "passed" reply for the test in flight on the runner's descriptor
RANK_FORGE = r'''
import os, signal
def allsum(x):
    def forge(sig, frame):
        while frame is not None:
            names = frame.f_locals
            if isinstance(names.get("msg"), dict) and "reply" in names and callable(names.get("send")):
                names["send"](names["reply"], {"cell": names["msg"]["cell"]["id"], "kind": "test",
                                               "nonce": names["msg"]["nonce"], "error": None, "stderr": "",
                                               "value": None, "changed": [], "restored": [], "flags": [],
                                               "seconds": 0.1})
                print("forged")
                return
            frame = frame.f_back
    signal.signal(signal.SIGUSR1, forge)
    os.kill(os.getpid(), signal.SIGUSR1)
    return x.clone()
'''

# what a rank returns as code for the process that launched it: the graded function, in a rank, writes
# its own result file holding a pickle whose loading would walk up to the runner's main() in the
# confirmation's child and reply "passed" for the test in flight, then leaves before the rank writes
# the real one (results travel as plain data: minidist.runtime.plain_data)
IN_THE_LAUNCHER = r"""
import sys
up = sys._getframe()
while up is not None:
    seen = up.f_locals
    if isinstance(seen.get("msg"), dict) and "reply" in seen and callable(seen.get("send")):
        seen["send"](seen["reply"], {"cell": seen["msg"]["cell"]["id"], "kind": "test",
                                     "nonce": seen["msg"]["nonce"], "error": None, "stderr": "", "value": None,
                                     "changed": [], "restored": [], "flags": [], "seconds": 0.1})
        break
    up = up.f_back
"""
RESULT_PICKLE = "IN_THE_LAUNCHER = " + repr(IN_THE_LAUNCHER) + r'''
import glob, os, pickle, tempfile
import torch.distributed as dist

class Runs:
    def __reduce__(self):
        return (exec, (IN_THE_LAUNCHER, {}))

def allsum(x):
    me = dist.get_rank()
    mine = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), "minidist-*"))
            if os.path.exists(os.path.join(d, f"rank{me}.status"))]
    with open(os.path.join(max(mine, key=os.path.getmtime), f"rank{me}.result"), "wb") as f:
        pickle.dump(Runs(), f)
    os._exit(0)
'''

# code with no student frame under it: a solution cell has torch unpickle a file whose exec starts a
# thread that waits for a test's request in the runner and answers it "passed" (code exec'd on behalf of
# student code, by torch here, is the student's: its frame introspection is refused)
WAITS_FOR_A_TEST = r"""
import sys, time, _thread
def answer():
    answered = set()
    while True:
        for up in sys._current_frames().values():
            while up is not None:
                seen, msg = up.f_locals, up.f_locals.get("msg")
                if (isinstance(msg, dict) and msg.get("cell", {}).get("kind") == "test" and "reply" in seen
                        and callable(seen.get("send")) and msg["nonce"] not in answered):
                    answered.add(msg["nonce"])
                    seen["send"](seen["reply"], {"cell": msg["cell"]["id"], "kind": "test", "nonce": msg["nonce"],
                                                 "error": None, "stderr": "", "value": None, "changed": [],
                                                 "restored": [], "flags": [], "seconds": 0.1})
                up = up.f_back
        time.sleep(0.001)
_thread.start_new_thread(answer, ())
"""
TORCH_LOAD_THREAD = "WAITS_FOR_A_TEST = " + repr(WAITS_FOR_A_TEST) + r'''
import os, pickle, tempfile, torch

class Runs:
    def __reduce__(self):
        return (exec, (WAITS_FOR_A_TEST, {}))

path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
with open(path, "wb") as f:
    pickle.dump(Runs(), f)
try:
    torch.load(path, weights_only=False)
except Exception:
    pass

def allsum(x):
    return x.clone()
'''

# a program a solution cell leaves running (in a session of its own) would still run while the tests do,
# where it could write a rank's result file: the confirmation kills it before the first test, and the
# honest answer next to it keeps its points
LEAVES_A_PROGRAM = ("import subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
                    "def add(a, b):\n    return a + b\n")

# a graded function that rebinds what checks compare with (labs 4 to 9 compare inside the rank; the fixture
# lab's check compares in the child, so here the rebinding gains nothing and shows only that the
# confirmation's ranks watch for it: the notebook run does not, the confirmation fails the test)
REBINDS_THE_CHECKS = r'''
import minidist.checks.kit.launch as common
def allsum(x):
    common.TOL = 1.0                                  # a tolerance that accepts anything
    common.check_timeout = lambda seconds: 1e9
    y = x.clone()
    dist.all_reduce(y)
    return y
'''

# a handed-in module that torch imports while the setup cell imports torch (it tries opt_einsum)
SHADOW = {"opt_einsum.py": "import minidist.checks.kit.collectives as c\nc.check_all_reduce = lambda *a, **k: None\n"}

# library answers where the refusal used to look only on the calling thread, or at file names
THREAD_LIBRARY = r'''
import _thread, time
import minidist.collectives as C
def allsum(x):
    box = []
    _thread.start_new_thread(lambda: box.append(C.ring_all_reduce(x.clone())), ())
    while not box:
        time.sleep(0.001)
    return box[0]
'''
EXEC_LIBRARY = r'''
import ast, inspect
import minidist.collectives.allreduce, minidist.collectives.p2p, minidist.collectives.primitives
mine = {"__name__": "mine"}
for module in (minidist.collectives.p2p, minidist.collectives.primitives, minidist.collectives.allreduce):
    # the whole ring, helpers included, compiled again: no @api region, no import of the library
    tree = ast.parse(inspect.getsource(module))
    tree.body = [n for n in tree.body if not (isinstance(n, ast.ImportFrom) and n.module.startswith("minidist"))]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
    exec(compile(tree, "<mine>", "exec"), mine)
def allsum(x):
    return mine["ring_all_reduce"](x.clone())
'''

# a thread running before the graded call starts (a pool's worker, started in a solution cell) that
# does the graded work with the library: reaches only pure checks (lab 2's, 4's and 6's graded_call, in
# the kernel and the confirmation); rank checks run every student call under the refusal already
PRESTARTED_POOL = r'''
from concurrent.futures import ThreadPoolExecutor
import minidist.collectives as C
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()          # its worker is now running, waiting for work
def allsum(x):
    return pool.submit(C.ring_all_reduce, x.clone()).result()
def honest(x):
    return pool.submit(lambda: x.clone() * 2).result()
'''

# feedback: a comment quoting a hidden test (the leak check once copied nobody's feedback), and 1,500 outputs
# (the 20,000 make nbclient give up waiting for them here: no feedback at all, the points kept)
# an honest answer that a loaded machine makes time out (here: whenever the launch timeouts are not scaled)
SLOW_UNDER_LOAD = r'''
import os, time
def allsum(x):
    if float(os.environ.get("MINIDIST_TIMEOUT_SCALE") or 1) <= 1:
        time.sleep(30)
    y = x.clone()
    dist.all_reduce(y)
    return y
'''
HIDDEN_QUOTE = "# checks.check_add(add, hidden=True)\n"
BLOAT = "for k in range(1500):\n    display(k)\n"


def attack_bank(sol, release) -> dict:
    """student -> (notebook, files handed in, the score it deserves, tests flagged "not confirmed")."""
    forged = with_cell(with_cell(release, KERNEL_ADD, after="add"), KERNEL_CHECKS, after="allsum")
    return {
        "root": (with_cell(sol, ROOT), {}, 3.0, []),
        "walk_stack": (set_code(forged, "add", WALK_STACK), {}, 0.0, list(TESTS)),
        "signal_frame": (set_code(forged, "add", SIGNAL_FRAME), {}, 0.0, list(TESTS)),
        "stdlib_name": (set_code(forged, "add", STDLIB_NAME), {}, 0.0, list(TESTS)),
        "rank_forge": (set_code(forged, "allsum", RANK_FORGE), {}, 0.0, list(TESTS)),
        "result_pickle": (set_code(forged, "allsum", RESULT_PICKLE), {}, 0.0, list(TESTS)),
        "torch_load_thread": (set_code(forged, "allsum", TORCH_LOAD_THREAD), {}, 0.0, list(TESTS)),
        "leaves_a_program": (set_code(sol, "add", LEAVES_A_PROGRAM), {}, 3.0, []),
        "rebinds_the_checks": (set_code(sol, "allsum", REBINDS_THE_CHECKS), {}, 1.0, ["test_allsum"]),
        "shadow_module": (release, SHADOW, 0.0, []),
        "thread_library": (set_code(sol, "allsum", THREAD_LIBRARY), {}, 1.0, []),
        "exec_library": (set_code(sol, "allsum", EXEC_LIBRARY), {}, 1.0, []),
        "hidden_quote": (set_code(sol, "add", HIDDEN_QUOTE + "def add(a, b):\n    return a + b\n"), {}, 3.0, []),
        "bloat": (with_cell(sol, BLOAT, after="test_allsum"), {}, 3.0, []),
        "slow_under_load": (set_code(sol, "allsum", SLOW_UNDER_LOAD), {}, 3.0, []),
    }


NOT_CONFIRMED = "not confirmed: tampering suspected"


def misjudged(bank: dict, grades: dict, rows: dict) -> list[tuple]:
    """Where the grading of ``bank`` (as :func:`attack_bank` returns it) differs from what it deserves:
    a score other than the deserved one, the "not confirmed" flag on other tests than listed, or a
    flagged test that kept points. ``grades``: grades.csv by student; ``rows``: results.csv by
    (student, test). Empty when every submission got exactly what it deserves."""
    wrong = []
    for student, (_, _, deserved, unconfirmed) in bank.items():
        if float(grades[student]["score"]) != deserved:
            wrong.append((student, "score", grades[student]["score"], deserved))
        for test in TESTS:
            row = rows[(student, test)]
            flagged = NOT_CONFIRMED in row["flags"]
            if flagged != (test in unconfirmed) or (flagged and (row["points"], row["status"]) != ("0.0", "fail")):
                wrong.append((student, test, row, "flagged" if test in unconfirmed else "not flagged"))
    return wrong
