"""Groups of t consecutive ranks inside one launch, for the checks that run every case of a test in
one launch of 4 ranks (``where="groups"``, :mod:`minidist.checks.kit.run`; labs 5, 6, 8 and 9): cutting
4 ranks into groups of t = 1..4 covers every group size a lab promises.

The likeliest cause of a wrong sum in a sub-group is a collective without ``group=`` (it runs over the
world): :func:`wrong_group_hint` says so when the observed value matches the same sum over the world
and not over the group. :func:`describe_case` is how a failure names a case.
"""
import torch
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


def wrong_group_hint(got, group_value, world_value, t: int, world_size: int, rtol: float = 1e-4) -> str:
    """The diagnosis of a wrong result in a group of ``t`` ranks: " It equals the sum over all 4 ranks
    (the world), not over the 2 of its group: ..." when ``got`` matches ``world_value`` (the same
    computation over every rank) and not ``group_value``; "" otherwise (or when the group is the world)."""
    if t == world_size or not all(isinstance(v, torch.Tensor) for v in (got, group_value, world_value)):
        return ""
    if got.shape != world_value.shape or got.shape != group_value.shape:
        return ""
    got, group_value, world_value = (v.detach().double().cpu() for v in (got, group_value, world_value))
    atol = rtol * max(1.0, world_value.abs().max().item())
    if torch.allclose(got, world_value, rtol=rtol, atol=atol) and not torch.allclose(got, group_value, rtol=rtol,
                                                                                       atol=atol):
        return (f" It equals the sum over all {world_size} ranks (the world), not over the {t} ranks of its "
                f"group: a collective ran without group= (the default group is the world).")
    return ""
