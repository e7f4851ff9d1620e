"""The launcher: results come back, failures become clear errors quickly, nothing is left running."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import minidist
from minidist.runtime.device import visible_gpus
from minidist import LaunchError
from conftest import forbid_starting_processes, pid_alive


def rank_info(scale, offset=0):
    t = torch.arange(3, dtype=torch.float64) * scale + dist.get_rank() + offset
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t, "threads": torch.get_num_threads()}


def test_results_come_back_by_rank_with_args_and_kwargs():
    out = minidist.launch(rank_info, 3, 2.0, offset=10)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["world"] == 3 for o in out)
    expected = 3 * (torch.arange(3, dtype=torch.float64) * 2.0 + 10) + (0 + 1 + 2)
    for o in out:
        assert torch.equal(o["sum"], expected)
        assert o["threads"] == max(1, (os.cpu_count() or 1) // 3)


def test_world_size_one_runs_in_a_group_of_one():
    assert minidist.launch(lambda: (dist.get_rank(), dist.get_world_size()), 1) == [(0, 1)]


def thread_cores():
    """After the group is made (gloo's threads exist): the cores each of this rank's threads may use."""
    return [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_ranks_outnumbering_the_cores_keep_each_to_one_core_shared_evenly():
    from minidist.runtime.cpu_affinity import core_for_rank
    assert [core_for_rank(r, 3, 0, [0, 1]) for r in range(3)] == [0, 1, 0]
    assert [core_for_rank(r, 3, 1, [4, 6]) for r in range(3)] == [6, 4, 6]
    assert core_for_rank(0, 2, 0, [0, 1]) is None and core_for_rank(0, 1, 0, [0]) is None
    before = os.sched_getaffinity(0)
    cores = sorted(before)[:2]          # a machine of many cores lends this test two
    os.sched_setaffinity(0, cores)
    try:
        over = minidist.launch(thread_cores, len(cores) + 1)
        fits = minidist.launch(thread_cores, len(cores))
    finally:
        os.sched_setaffinity(0, before)
    pinned = []
    for rank, threads in enumerate(over):
        assert len(threads) > 1, "gloo's threads are running"
        assert all(t == threads[0] and len(t) == 1 for t in threads), f"rank {rank}: {threads}"
        pinned.append(threads[0][0])
    assert set(pinned) == set(cores) and max(map(pinned.count, cores)) - min(map(pinned.count, cores)) <= 1
    assert all(t == cores for threads in fits for t in threads), "as many cores as ranks: nothing pinned"


def test_returned_views_are_copied_small():
    out = minidist.launch(lambda: torch.arange(1_000_000.0)[:4], 2)
    assert out[0].untyped_storage().nbytes() == 16


def test_spawn_path_ships_closures_with_cloudpickle():
    factor = 7

    def closure():
        t = torch.tensor([float(dist.get_rank() * factor)])
        dist.all_reduce(t)
        return t.item()

    assert minidist.launch(closure, 2, start_method="spawn") == [7.0, 7.0]


@pytest.mark.parametrize("bad, match", [
    (dict(world_size=0), "world_size"),
    (dict(world_size="2"), "world_size"),
    (dict(world_size=2, timeout=-1), "timeout"),
    (dict(world_size=2, backend="mpi"), "backend"),
    (dict(world_size=2, start_method="forkserver"), "start_method"),
    (dict(world_size=1000), "world_size"),
])
def test_bad_arguments_are_rejected_before_any_process_starts(bad, match, monkeypatch):
    forbid_starting_processes(monkeypatch)
    with pytest.raises(ValueError, match=match):
        minidist.launch(rank_info, **bad)


@pytest.mark.skipif(visible_gpus() >= 2, reason="needs a machine with fewer than 2 GPUs")
def test_nccl_without_enough_gpus_is_a_clear_error():
    with pytest.raises(ValueError, match="one GPU per rank"):
        minidist.launch(rank_info, 2, 1.0, backend="nccl")


def test_not_a_function():
    with pytest.raises(TypeError, match="function"):
        minidist.launch("rank_info", 2)


def raise_on_rank_2_while_others_block():
    if dist.get_rank() == 2:
        time.sleep(0.2)
        raise ValueError("bad shard size 7")
    t = torch.zeros(4)
    dist.all_reduce(t)      # blocks: rank 2 never joins


def test_exception_while_others_block_is_reported_within_5s():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        minidist.launch(raise_on_rank_2_while_others_block, 4, timeout=60)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "rank 2 raised: ValueError: bad shard size 7" in message
    assert "test_launch.py" in message and 'raise ValueError("bad shard size 7")' in message
    assert list(info.value.failures)[0] == 2, "the cause must be listed before its consequences"
    assert "Exception raised from" not in message     # C++ frames are trimmed


def ring_where_everyone_receives_first():
    rank, n = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(1000)
    dist.recv(buf, src=(rank - 1) % n)
    dist.send(buf, dst=(rank + 1) % n)


def test_deadlock_names_each_stuck_rank_and_op_within_timeout():
    timeout = 2.0
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        minidist.launch(ring_where_everyone_receives_first, 3, timeout=timeout)
    assert time.monotonic() - start < timeout + 5
    message = str(info.value)
    for rank in range(3):
        assert f"rank {rank}" in message
        assert f"recv(src={(rank - 1) % 3}, 3.9 KiB)" in message
    assert "dist.recv(buf, src=(rank - 1) % n)" in message      # the user's line, with its source


def sleep_then_return(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def test_timeout_scale_gives_a_loaded_machine_more_time(monkeypatch):
    with pytest.raises(LaunchError, match="after 0.5 s"):
        minidist.launch(sleep_then_return, 2, 3.0, timeout=0.5)
    monkeypatch.setenv("MINIDIST_TIMEOUT_SCALE", "10")          # the grader's retry of a timed-out test
    assert minidist.launch(sleep_then_return, 2, 3.0, timeout=0.5) == [0, 1]
    monkeypatch.setenv("MINIDIST_TIMEOUT_SCALE", "fast")
    with pytest.raises(ValueError, match="MINIDIST_TIMEOUT_SCALE"):
        minidist.launch(sleep_then_return, 2, 0.0, timeout=1)


def spin_on_rank_0():
    if dist.get_rank() == 0:
        while True:
            pass
    dist.recv(torch.zeros(2), src=0)


def test_infinite_loop_is_reported_with_its_line():
    with pytest.raises(LaunchError) as info:
        minidist.launch(spin_on_rank_0, 2, timeout=1.5)
    message = str(info.value)
    rank0 = message.split("rank 0: ")[1].split("rank 1")[0]
    assert rank0.startswith("busy in Python code") and "in spin_on_rank_0" in rank0, message
    assert re.search(r"^\s+(while True:|pass)$", rank0, re.MULTILINE), message     # either line of the loop
    assert "rank 1" in message and "recv(src=0, 8 B)" in message


@pytest.mark.parametrize("body, expected", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by signal SIGKILL"),
    ("os.kill(os.getpid(), signal.SIGSEGV)", "killed by signal SIGSEGV"),
    ("sys.exit(3)", "called sys.exit(3)"),
    ("os._exit(0)", "without returning a result"),
    ("os._exit(4)", "exited with code 4"),
    ("return (x for x in range(3))", "cannot be sent back"),
])
def test_abnormal_rank_exits_are_named(body, expected):
    namespace = {}
    exec(textwrap.dedent(f"""
        import os, signal, sys
        import torch.distributed as dist
        def misbehave():
            if dist.get_rank() == 1:
                {body}
            return dist.get_rank()
    """), namespace)
    with pytest.raises(LaunchError) as info:
        minidist.launch(namespace["misbehave"], 2, timeout=10)
    assert "rank 1" in str(info.value) and expected in str(info.value)


def test_rank_output_is_relayed_with_rank_prefix(capsys):
    minidist.launch(lambda: print("hello", dist.get_rank()), 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello 0" in out and "[rank 1] hello 1" in out


def test_megabytes_of_output_are_capped(capsys):
    minidist.launch(lambda: print("x" * 1000 + "\n" * 0, end="\n" * 1) if False else [print("y" * 1000) for _ in range(2000)] and None, 1)
    out = capsys.readouterr().out
    assert len(out) < 200_000 and "output beyond" in out


def test_eight_concurrent_launches_do_not_collide():
    results, errors = {}, []

    def one(i):
        try:
            results[i] = minidist.launch(rank_info, 4, 1.0, offset=100 * i, timeout=60)
        except Exception as err:    # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, out in results.items():
        expected = 4 * (torch.arange(3, dtype=torch.float64) + 100 * i) + 6
        assert all(torch.equal(o["sum"], expected) for o in out)
    assert len(results) == 8


def record_pids_then_misbehave(pid_dir, how):
    child = subprocess.Popen(["sleep", "60"])       # a grandchild: must die with the launch
    with open(os.path.join(pid_dir, f"{os.getpid()}-{child.pid}"), "w"):
        pass
    if how == "raise" and dist.get_rank() == 0:
        raise RuntimeError("boom")
    if how == "hang":
        dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
    time.sleep(60)


def _recorded_pids(pid_dir):
    return [int(p) for name in os.listdir(pid_dir) for p in name.split("-")]


def test_no_process_left_after_failing_launches(tmp_path):
    for how in ("raise", "hang", "raise"):
        with pytest.raises(LaunchError):
            minidist.launch(record_pids_then_misbehave, 3, str(tmp_path), how, timeout=1.5)
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 3 * 3 * 2
    time.sleep(0.2)
    assert not [p for p in pids if pid_alive(p)]


PARENT_SCRIPT = """
import sys, minidist
sys.path.insert(0, {tests!r})
from test_launch import record_pids_then_misbehave
minidist.launch(record_pids_then_misbehave, 2, {pid_dir!r}, "sleep", timeout=120)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_interrupted_or_killed_parent_leaves_no_rank_behind(tmp_path, sig):
    script = PARENT_SCRIPT.format(tests=os.path.dirname(__file__), pid_dir=str(tmp_path))
    # A child inherits an ignored SIGINT (something earlier in a long pytest run may ignore it);
    # the process under test must be one that Ctrl-C / a kernel's stop button reaches.
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir(tmp_path)) == 2
    parent.send_signal(sig)     # SIGINT: a notebook's stop button; SIGKILL: the kernel dies
    parent.wait(timeout=30)     # generous: on a loaded 2-core machine a torch interpreter exits slowly
    ranks = [int(name.split("-")[0]) for name in os.listdir(tmp_path)]
    grandchildren = [int(name.split("-")[1]) for name in os.listdir(tmp_path)]
    deadline = time.monotonic() + 5
    while any(pid_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in ranks if pid_alive(p)]
    if sig == signal.SIGINT:    # the parent ran its cleanup: whole process groups are gone
        assert not [p for p in grandchildren if pid_alive(p)]
    else:                       # nobody is left to kill the grandchildren: do it here
        for p in grandchildren:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parallel_work():
    x = torch.randn(256, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return float((x @ x.T).sum())


def test_a_forked_rank_runs_after_the_parent_used_its_thread_pool():
    """libgomp cannot reuse a parent's OpenMP pool after fork: a 1-rank launch after the
    parent ran a 2-thread matmul used to hang in its first parallel op (seen in CI)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        (a @ a).sum()
        [got] = minidist.launch(_parallel_work, 1, timeout=20, start_method="fork")
    finally:
        torch.set_num_threads(threads)
    assert got == pytest.approx(_parallel_work(), rel=1e-12)


def test_a_forked_rank_inherits_what_building_an_optimizer_imports():
    # else each rank of each launch imports ~800 modules (~1.4 s) when it builds its optimizer;
    # a process that imports a training harness imports them once, before forking
    probe = ("import sys, minidist\n"
             "f = lambda: 'torch._dynamo' in sys.modules\n"
             "before = minidist.launch(f, 2)\n"
             "import minidist.harness.data_parallel\n"
             "print(before, minidist.launch(f, 2))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["[False,", "False]", "[True,", "True]"], out.stderr[-2000:]


def receive_the_wrong_dtype():
    if dist.get_rank() == 0:
        dist.send(torch.ones(4, dtype=torch.float64), 1)
    else:
        dist.recv(torch.empty(4), 0)


def test_a_rank_aborted_in_cpp_is_reported_with_the_cause_and_the_line(capsys):
    with pytest.raises(LaunchError) as info:
        minidist.launch(receive_the_wrong_dtype, 2, timeout=10)
    message = str(info.value)
    summary, _, details = message.partition("\n\ndetails: ")
    assert summary.startswith("1 of 2 ranks failed\nrank 1: killed by signal SIGABRT")   # the summary first
    assert "Received data size doesn't match" in summary               # gloo's own words
    assert "dist.recv(torch.empty(4), 0)" in summary                   # the user's line
    assert "launcher.py" not in summary                                # not the parent's frames
    # faulthandler's dump is folded: not relayed line by line before the error, kept (trimmed) after it
    relayed = capsys.readouterr().out
    assert "Fatal Python error" not in relayed and "Extension modules" not in relayed
    assert "[rank 1] crashed: its dump" in relayed
    assert details.startswith("rank 1's crash output") and "in recv" in details and "Thread 0x" in details
    assert "Extension modules" not in details and len(details.splitlines()) <= 30


def test_results_come_back_as_plain_data_whatever_their_nesting():
    from minidist.trace.events import Event, Trace

    def body():
        r = dist.get_rank()
        trace = Trace([Event("send", r, 1 - r, None, 8, 0.0, 1.0, where="x.py:1")])
        return {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + r, (r, "k"): [1.5, float("inf"), None],
                "tuple": (torch.float16, torch.Size([2]), {1, 2}), "trace": trace, "bytes": b"\x00\x01"}

    out = minidist.launch(body, 2)
    assert torch.equal(out[1]["t"], torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + 1)
    assert out[1][(1, "k")] == [1.5, float("inf"), None] and out[0]["bytes"] == b"\x00\x01"
    assert out[0]["tuple"] == (torch.float16, torch.Size([2]), {1, 2})
    assert [(e.op, e.peer, e.nbytes) for e in out[1]["trace"].events] == [("send", 0, 8)]


def test_a_module_returned_is_a_clear_error_that_names_where_it_sits():
    with pytest.raises(LaunchError, match=r"result\[1\]\['model'\]: a Linear.*state_dict\(\)"):
        minidist.launch(lambda: [0, {"model": torch.nn.Linear(2, 2)}], 1)


def test_a_rank_that_writes_a_pickle_as_its_result_runs_nothing_in_the_launcher(tmp_path):
    """A rank runs code the launcher does not trust (the grader's checks launch the student's): a
    pickle it leaves as its result would run ``exec`` here when loaded. It is refused unread."""
    marker = tmp_path / "ran-in-the-launcher"

    def body():
        import pickle

        class Runs:
            def __reduce__(self):
                return (exec, (f"open({str(marker)!r}, 'w').close()",))

        # its own launch's folder, from the stack file every rank keeps open there (the newest
        # minidist-* folder may be another launch's: pytest's workers launch side by side)
        held = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                held.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        run_dir = next(os.path.dirname(p) for p in held if p.endswith(f"rank{dist.get_rank()}.stack"))
        with open(os.path.join(run_dir, f"rank{dist.get_rank()}.result"), "wb") as f:
            pickle.dump(Runs(), f)
        os._exit(0)

    with pytest.raises(LaunchError, match="rank 0 wrote a result that is not plain data"):
        minidist.launch(body, 1)
    assert not marker.exists()


def test_plain_data_refuses_what_it_did_not_write():
    from minidist.runtime import plain_data
    for bad in (b"\x80\x04K\x01.", b'{"dtype": "os.system"}', b'{"tensor": {"dtype": "float32", "shape": [3], "data": "AAAA"}}',
                b'{"module": "os"}', b'{"tensor": {"dtype": "float32", "shape": [-1], "data": ""}}', b"[" * 100_000,
                b'{"record": ["os", "system", {}]}', b'{"record": ["minidist.trace.events", "Trace", {}]}',
                b'{"record": ["minidist.trace.events", "Event", {"op": "send"}]}'):
        with pytest.raises(ValueError, match="not plain data"):
            plain_data.loads(bad)
