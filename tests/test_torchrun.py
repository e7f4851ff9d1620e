"""Under torchrun, launch() runs on the rank torchrun made and gathers every rank's result."""
import subprocess
import sys

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
