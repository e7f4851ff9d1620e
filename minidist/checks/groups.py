"""Checks that run a case on groups of t ranks inside one launch (labs 5 and 6): the groups,
and how a failure names its case and rank. Cutting 4 ranks into groups of t = 1..4 lets one
launch cover every group size a lab promises."""
import torch.distributed as dist


def consecutive_groups(sizes, world_size: int) -> dict:
    """Inside a rank: {t: (group, my rank in it, its size)} for blocks of t consecutive ranks
    (t = 3 on 4 ranks leaves the last rank in a group of one; t = world_size is ``None``, the
    default group). Every rank creates every group, as ``dist.new_group`` requires."""
    out, rank = {}, dist.get_rank()
    for t in sorted(set(sizes)):
        if t == world_size:
            out[t] = (None, rank, world_size)
            continue
        for start in range(0, world_size, t):
            members = list(range(start, min(start + t, world_size)))
            group = dist.new_group(members)
            if rank in members:
                out[t] = (group, rank - start, len(members))
    # Past this barrier every rank has finished connecting to its groups. Without it a rank
    # whose cases send nothing (zigzag_shard) can exit while a peer is still connecting to it,
    # and the peer fails in new_group ("Gloo connectFullMesh failed"; seen once under load).
    dist.barrier()
    return out


def describe_case(case: dict) -> str:
    """A case's settings as a failure names them ("h=8, dtype=float64"), its group size t left out."""
    return ", ".join(f"{k}={getattr(v, '__name__', str(v).replace('torch.', ''))}" for k, v in case.items()
                     if k != "t") or "default sizes"


def raise_first_group_problem(name: str, cases: list[dict], results: list, world_size: int) -> None:
    """``results[rank][i]`` is ``(rank in its group, t, problem or None)`` for case i: raise for the first problem."""
    for i, case in enumerate(cases):
        for rank in range(world_size):
            r, t, problem = results[rank][i]
            if problem:
                raise AssertionError(f"{name} (t={t}, {describe_case(case)}), rank {rank} (rank {r} of its group): "
                                     f"{problem}")
