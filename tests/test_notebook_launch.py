"""minidist.launch from a real Jupyter kernel: functions defined in cells, and a deadlock diagnosed."""
import nbformat
from nbclient import NotebookClient

CELLS = [
    "import torch, torch.distributed as dist, minidist",
    # a function defined in a cell, launched on 4 ranks (fork: the child is a copy of the kernel)
    "def allreduce_rank():\n"
    "    t = torch.tensor([float(dist.get_rank())])\n"
    "    dist.all_reduce(t)\n"
    "    print('rank', dist.get_rank(), 'sees', t.item())\n"
    "    return t.item()\n"
    "results = minidist.launch(allreduce_rank, 4)\n"
    "assert results == [6.0] * 4, results",
    # the same through fresh interpreters (cloudpickle ships the cell's function)
    "assert minidist.launch(allreduce_rank, 2, start_method='spawn') == [1.0, 1.0]",
    # the classic deadlock: every rank receives first
    "def ring():\n"
    "    buf = torch.zeros(4)\n"
    "    dist.recv(buf, src=(dist.get_rank() - 1) % dist.get_world_size())\n"
    "    dist.send(buf, dst=(dist.get_rank() + 1) % dist.get_world_size())\n"
    "try:\n"
    "    minidist.launch(ring, 2, timeout=2)\n"
    "except minidist.LaunchError as err:\n"
    "    print(err)",
]


def test_cells_define_and_launch_functions(kernel_name):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    NotebookClient(nb, kernel_name=kernel_name, timeout=120).execute()
    text = lambda cell: "".join(o.get("text", "") for o in cell.outputs)
    launch_out = text(nb.cells[1])
    assert all(f"[rank {r}] rank {r} sees 6.0" in launch_out for r in range(4))
    deadlock = text(nb.cells[3])
    assert "rank 0" in deadlock and "recv(src=1, 16 B)" in deadlock
    assert "rank 1" in deadlock and "recv(src=0, 16 B)" in deadlock
    assert 'notebook cell "ring", line 3, in ring' in deadlock       # the cell named by its title
    assert "dist.recv(buf, src=" in deadlock       # the cell's own source line is shown
