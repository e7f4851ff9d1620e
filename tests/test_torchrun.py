"""Under torchrun, launch() runs on the rank torchrun made and gathers every rank's result; the
elastic agent's restart (--max-restarts) resumes a crashed job from its checkpoint."""
import os
import signal
import subprocess
import sys
import time

SCRIPT = """
import os, torch, torch.distributed as dist, minidist
from minidist.trace import trace

def step(scale):
    with trace() as t:
        x = torch.full((4,), float(dist.get_rank() + 1)) * scale
        dist.all_reduce(x)
    return {"rank": dist.get_rank(), "sum": x[0].item(), "ops": dict(t.op_counts()), "pid": os.getpid(),
            "where": (str(minidist.device()), torch.backends.cudnn.allow_tf32)}

out = minidist.launch(step, int(os.environ["WORLD_SIZE"]), 10.0)
if dist.get_rank() == 0:
    print("RESULT", [(o["rank"], o["sum"], o["ops"]) for o in out], len({o["pid"] for o in out}))
    print("WHERE", [o["where"] for o in out])
try:
    minidist.launch(step, 5, 1.0)
except ValueError as err:
    if dist.get_rank() == 0:
        print("MISMATCH", err)
try:
    minidist.launch(step, 2, 1.0, device="cuda")
except ValueError as err:
    if dist.get_rank() == 0:
        print("NO GPU", err)
"""


def test_launch_under_torchrun_gathers_all_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT [(0, 30.0, {'all_reduce': 1}), (1, 30.0, {'all_reduce': 1})] 2" in proc.stdout
    assert "MISMATCH launch(world_size=5) under torchrun with WORLD_SIZE=2: they must match" in proc.stdout
    assert "WHERE [('cpu', False), ('cpu', False)]" in proc.stdout      # the rank's device set, TF32 off
    assert "NO GPU device='cuda' needs one GPU per rank: world_size=2, but this machine has 0 visible GPU(s)" in proc.stdout


ELASTIC_JOB = """
import json, os, sys
import minidist
from minidist.harness import checkpoint as harness

root, marker = sys.argv[1], sys.argv[2]
out = minidist.launch(harness.train, 2, ("ddp", "fp16"), root, 4, every=2, noise=0.05, crash_at=(1, 3, "save"),
                      crash_marker=marker)
if int(os.environ["RANK"]) == 0:
    print("RESULT", json.dumps([[o["start"], o["restarts"]] for o in out]), flush=True)
"""


def _session_members(sid: int) -> list[int]:
    """Processes still alive (not zombies) in session ``sid``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":      # fields after the name: state, ppid, pgrp, session
            out.append(int(pid))
    return out


def test_torchruns_elastic_agent_restarts_a_crashed_worker_and_the_job_ends_as_uninterrupted(tmp_path):
    """torchrun --standalone (its c10d rendezvous on a free port it picks) --max-restarts 1 on 2 CPU
    workers: worker 1 dies mid-save at step 4, the agent restarts both, they resume from step 2
    and end with the uninterrupted run's checkpoint, bit for bit (random states, loss scale, data
    position included). Bounded in time; nothing of the job is left running."""
    from minidist.harness import checkpoint as harness
    from minidist.runtime import launch
    from test_checkpoint_state import _same_checkpoint

    reference = str(tmp_path / "reference")
    launch(harness.train, 2, ("ddp", "fp16"), reference, 4, every=2, noise=0.05)
    script, root, marker = tmp_path / "job.py", tmp_path / "ckpts", tmp_path / "crash-once"
    script.write_text(ELASTIC_JOB)
    marker.touch()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                             "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.1",
                             str(script), str(root), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert not marker.exists()                          # the crash happened
    assert "RESULT [[2, 1], [2, 1]]" in stdout, stdout  # both workers restarted once and resumed from step 2
    _same_checkpoint(str(root / "step_00000004"), os.path.join(reference, "step_00000004"))
    deadline = time.monotonic() + 10
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_members(proc.pid) == []
