"""The 3D device mesh: which rank holds which (dp, pp, tp) coordinate, and its groups.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (Sec. 3, "PTD-P"): the n = d·p·t ranks form a grid of shape
(d, p, t), row-major, tensor parallelism innermost. Rank r sits at

    (i_dp, i_pp, i_tp) = (r // (p·t), (r // t) % p, r % t)

and belongs to three groups, one per axis: the ranks that differ from it in that
coordinate only. Innermost means the t ranks of a TP group are *consecutive*, i.e. on
one node when t divides the GPUs per node: TP's all-reduces, two per sub-layer and
micro-batch, then run over NVLink; PP's point-to-point messages and DP's one
all-reduce per step may cross nodes (Sec. 3.3, takeaway #1).

The mesh itself is torch's (``init_device_mesh`` with named dims; on gloo too). This
module adds what a course needs around it: :func:`mesh_groups` writes the groups down
without any process (same order as torch's mesh, tested), :func:`rank_grid` prints
them, :func:`innermost_contiguous` checks the TP-on-one-node rule, and
:func:`check_layout` refuses a layout before any rank communicates.
"""
from __future__ import annotations

from itertools import product

from minidist.runtime.device import device as current_device

AXES = ("dp", "pp", "tp")


def _positive(**sizes) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def check_layout(world_size: int, dp: int, pp: int, tp: int) -> None:
    """``ValueError`` unless dp·pp·tp = world_size (all positive integers)."""
    _positive(world_size=world_size, dp=dp, pp=pp, tp=tp)
    if dp * pp * tp != world_size:
        raise ValueError(f"a (dp={dp}, pp={pp}, tp={tp}) mesh holds {dp * pp * tp} ranks, "
                         f"not the world's {world_size}")


def coordinate(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(i_dp, i_pp, i_tp) of global ``rank`` in the row-major (dp, pp, tp) grid."""
    check_layout(dp * pp * tp, dp, pp, tp)
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * pp * tp} ranks")
    return rank // (pp * tp), (rank // tp) % pp, rank % tp


def rank_of(i_dp: int, i_pp: int, i_tp: int, pp: int, tp: int) -> int:
    """Global rank at coordinate (i_dp, i_pp, i_tp) of a mesh whose inner sizes are pp and tp."""
    return (i_dp * pp + i_pp) * tp + i_tp


def mesh_groups(world_size: int, dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """The rank lists of every DP, PP and TP group, as torch's ``init_device_mesh(..., (dp, pp, tp))``
    makes them: for each axis, one group per setting of the other two coordinates, in
    row-major order of those, each group's ranks in increasing order of its own coordinate.

    >>> mesh_groups(8, 2, 2, 2)["tp"]
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    """
    check_layout(world_size, dp, pp, tp)
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    out = {}
    for axis in AXES:
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in product(*(range(sizes[a]) for a in others)):
            coord = dict(zip(others, fixed))
            at = [coord | {axis: i} for i in range(sizes[axis])]
            groups.append([rank_of(c["dp"], c["pp"], c["tp"], pp, tp) for c in at])
        out[axis] = groups
    return out


def groups_of(rank: int, dp: int, pp: int, tp: int) -> dict[str, list[int]]:
    """The three groups ``rank`` belongs to."""
    groups = mesh_groups(dp * pp * tp, dp, pp, tp)
    return {axis: next(g for g in groups[axis] if rank in g) for axis in AXES}


def innermost_contiguous(groups: list[list[int]], gpus_per_node: int | None = None) -> bool:
    """True when every group (e.g. the TP groups of a mesh, :func:`mesh_groups` or torch's)
    is a run of consecutive ranks and, given ``gpus_per_node``, lies inside one node
    (ranks r and r' share a node when r // g == r' // g). Strided TP groups fail."""
    for group in groups:
        group = sorted(group)
        if group != list(range(group[0], group[0] + len(group))):
            return False
        if gpus_per_node and group[0] // gpus_per_node != group[-1] // gpus_per_node:
            return False
    return True


def rank_grid(dp: int, pp: int, tp: int, gpus_per_node: int | None = None) -> str:
    """A printable table: each rank's coordinate, node (when ``gpus_per_node`` is given) and groups."""
    n = dp * pp * tp
    check_layout(n, dp, pp, tp)
    head = ["rank", "(dp, pp, tp)"] + (["node"] if gpus_per_node else []) + ["DP group", "PP group", "TP group"]
    rows = []
    for r in range(n):
        g = groups_of(r, dp, pp, tp)
        rows.append([str(r), str(coordinate(r, dp, pp, tp))] + ([str(r // gpus_per_node)] if gpus_per_node else [])
                    + [str(g["dp"]), str(g["pp"]), str(g["tp"])])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    ok = innermost_contiguous(mesh_groups(n, dp, pp, tp)["tp"], gpus_per_node)
    where = " inside one node" if gpus_per_node else ""
    note = f"TP groups are consecutive ranks{where}: {'yes' if ok else 'NO'}"
    return "\n".join([f"mesh dp={dp} x pp={pp} x tp={tp} ({n} ranks)", fmt(head), *map(fmt, rows), note])


def make_mesh(dp: int, pp: int, tp: int, device_type: str | None = None):
    """torch's ``DeviceMesh`` of shape (dp, pp, tp) with dims named "dp", "pp", "tp", over the
    current world (checked first: a wrong size raises before any group is created), on this
    rank's device type (``minidist.device().type``) unless ``device_type`` says otherwise.
    ``mesh.get_group("tp")`` is this rank's TP group, and so on."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    check_layout(dist.get_world_size(), dp, pp, tp)
    return init_device_mesh(device_type or current_device().type, (dp, pp, tp), mesh_dim_names=AXES)
