"""minidist.checks: correct code passes, and each realistic bug fails with a message that
says what was expected, what was seen, on which rank and for which input.

The "student" functions below are written the way lab 1 asks (default group, plain
isend/irecv), once correctly and once with each classic mistake."""
import pytest
import torch
import torch.distributed as dist

import minidist
from minidist import collectives as C
from minidist.checks import lab1_collectives as lab1
from minidist.checks.kit import collectives as checks
from minidist.checks.kit.check import Registry
from minidist.checks.kit.run import run

TESTS = Registry(__name__)       # the kit's collective checks, on other cases than lab 1's


def check_collective(fn, kind, world_sizes=(1, 2, 3, 4, 5), lengths=(1, 3, 8, 13),
                     dtypes=(torch.float32, torch.float64), roots=None, pattern=None, allow=checks.P2P_ONLY,
                     timeout=15.0):
    """``fn`` as a ``kind`` collective on every world size x length x dtype (x root), through a kit Check
    (library answers not refused here), and its traced ``pattern``."""
    launches = checks.collective_cases(kind, world_sizes, lengths, dtypes, roots, name=fn.__name__, pattern=pattern,
                                       allow=allow)
    check = checks.check(TESTS, f"{fn.__name__} {len(TESTS.checks)}", lambda: launches, params=(),
                         function=fn.__name__, timeout=timeout)
    run(check, fn)


def sendrecv(send, dst, recv, src):
    reqs = [dist.isend(send, dst=dst), dist.irecv(recv, src=src)]
    for q in reqs:
        q.wait()


def _ring(tensor, off_by_one=False, skip_all_gather=False):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = tensor.flatten().clone()
    chunks = out.tensor_split(n)
    right, left = (rank + 1) % n, (rank - 1) % n
    shift = 1 if off_by_one else 0
    for s in range(n - 1):                              # reduce-scatter
        send_i, recv_i = (rank - s - 1 + shift) % n, (rank - s - 2) % n
        incoming = torch.empty_like(chunks[recv_i])
        sendrecv(chunks[send_i], right, incoming, left)
        chunks[recv_i].add_(incoming)
    if skip_all_gather:
        return out.view(tensor.shape)
    for s in range(n - 1):                              # all-gather
        sendrecv(chunks[(rank - s) % n], right, chunks[(rank - s - 1) % n], left)
    return out.view(tensor.shape)


def ring_all_reduce(tensor):
    return _ring(tensor)


def ring_off_by_one(tensor):
    return _ring(tensor, off_by_one=True)


def ring_without_all_gather(tensor):
    return _ring(tensor, skip_all_gather=True)


def ring_whole_tensor(tensor):
    """Right answer (summed in rank order, so identical everywhere), neighbours only,
    but the whole tensor travels at every step."""
    rank, n = dist.get_rank(), dist.get_world_size()
    everyone = {rank: tensor.clone()}
    for s in range(n - 1):
        incoming = torch.empty_like(tensor)
        sendrecv(everyone[(rank - s) % n], (rank + 1) % n, incoming, (rank - 1) % n)
        everyone[(rank - s - 1) % n] = incoming
    return sum(everyone[r] for r in range(n))


def ring_everyone_sends_first(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    out = tensor.clone()
    incoming = torch.empty_like(out)
    dist.send(out, dst=(rank + 1) % n)                  # blocking: every rank waits for a receiver
    dist.recv(incoming, src=(rank - 1) % n)
    return out + incoming


def ring_calls_all_reduce(tensor):
    out = tensor.clone()
    dist.all_reduce(out)
    return out


def ring_calls_minidist(tensor):
    return C.ring_all_reduce(tensor)


def ring_in_place(tensor):
    out = ring_all_reduce(tensor)
    tensor.copy_(out)
    return out


def naive_all_reduce_via_ring(tensor):       # right answer, wrong pattern for "naive"
    return ring_all_reduce(tensor)


def halving_all_reduce(tensor):
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tensor.flatten().clone()
    bounds = [0]
    for chunk in out.tensor_split(world):
        bounds.append(bounds[-1] + chunk.numel())
    part = lambda a, b: out[bounds[a]:bounds[b]]       # noqa: E731
    lo, hi, rounds, d = 0, world, [], 1
    while d < world:
        partner, mid = rank ^ d, (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank < partner else ((mid, hi), (lo, mid))
        incoming = torch.empty_like(part(*keep))
        sendrecv(part(*give), partner, incoming, partner)
        part(*keep).add_(incoming)
        rounds.append((partner, keep, give))
        lo, hi = keep
        d *= 2
    for partner, keep, give in reversed(rounds):
        sendrecv(part(*keep), partner, part(*give), partner)
    return out.view(tensor.shape)


def halving_via_wrapped(tensor):
    return C.recursive_halving_all_reduce.__wrapped__(tensor)   # the implementation, without its api marker


def halving_as_ring(tensor):                 # right answer and bytes, but 2(N-1) ring steps
    return ring_all_reduce(tensor)


def ring_reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = tensor.clone().tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(rank - s - 2) % n])
        sendrecv(chunks[(rank - s - 1) % n], (rank + 1) % n, incoming, (rank - 1) % n)
        chunks[(rank - s - 2) % n].add_(incoming)
    return chunks[rank].clone()


def broadcast(tensor, src):
    out = tensor.clone()
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(out, dst=peer)
    else:
        dist.recv(out, src=src)
    return out


def broadcast_from_zero(tensor, src):
    return C.broadcast.__wrapped__(tensor, 0)


# ----------------------------------------------------------------------------- passing
def test_correct_student_functions_pass_the_lab1_checks():
    lab1.check_ring_all_reduce(ring_all_reduce, hidden=True)
    lab1.check_ring_all_reduce_pattern(ring_all_reduce)
    run(lab1.FUNCTIONS["recursive_halving_all_reduce"], halving_all_reduce, hidden=True)
    lab1.check_recursive_halving_all_reduce_pattern(halving_all_reduce)
    lab1.check_ring_reduce_scatter(ring_reduce_scatter)
    lab1.check_ring_reduce_scatter_pattern(ring_reduce_scatter)
    lab1.check_broadcast(broadcast)


def test_lab1_refuses_the_library_however_it_is_reached():
    """``__wrapped__`` (no api marker), an inner helper, and a swallowed first refusal: all fail lab 1."""
    for fn, what in ((halving_via_wrapped, "minidist.collectives.allreduce.recursive_halving_all_reduce"),
                     (ring_via_inner_helper, "minidist.collectives.primitives.ring_reduce_scatter_into"),
                     (ring_swallowing_the_refusal, "minidist.collectives.allreduce.ring_all_reduce")):
        check = lab1.check_recursive_halving_all_reduce if fn is halving_via_wrapped else lab1.check_ring_all_reduce
        with pytest.raises(AssertionError, match="called minidist's own implementation") as info:
            check(fn)
        assert what in str(info.value) and "minidist.checks.lab1_collectives" in str(info.value)


def ring_via_inner_helper(tensor):
    from minidist.collectives.primitives import ring_all_gather_into, ring_reduce_scatter_into
    out = tensor.flatten().clone()
    ring_reduce_scatter_into(out, dist.get_rank(), dist.get_world_size(), None)
    ring_all_gather_into(out, dist.get_rank(), dist.get_world_size(), None)
    return out.view(tensor.shape)


def ring_swallowing_the_refusal(tensor):
    try:
        return C.ring_all_reduce.__wrapped__(tensor)
    except Exception:
        return C.ring_all_reduce.__wrapped__(tensor)


def test_library_passes_when_its_own_api_is_allowed():
    allow = checks.P2P_ONLY | {"minidist.naive_all_reduce", "minidist.all_gather"}
    check_collective(C.naive_all_reduce, "all_reduce", world_sizes=(1, 3), pattern="naive", allow=allow)
    check_collective(C.all_gather, "all_gather", world_sizes=(3,), pattern="ring_all_gather", allow=allow)
    with pytest.raises(AssertionError, match="rank 0"):          # an all-gather is not a reduce-scatter
        check_collective(C.all_gather, "all_gather", world_sizes=(3,), pattern="ring_reduce_scatter", allow=allow)


# ----------------------------------------------------------------------------- failing
def _fails(fn, match, kind="all_reduce", world_sizes=(3,), pattern=None, exc=AssertionError, **kw):
    with pytest.raises(exc) as info:
        check_collective(fn, kind, world_sizes, lengths=(7,), dtypes=(torch.float32,), pattern=pattern, **kw)
    message = str(info.value)
    for text in match:
        assert text in message, f"{text!r} not in:\n{message}"
    return message


def test_off_by_one_chunk_index_is_a_wrong_result_with_the_input_and_rank():
    with pytest.raises(AssertionError) as info:     # equal chunks: the sizes match, the sums do not
        check_collective(ring_off_by_one, "all_reduce", world_sizes=(3,), lengths=(9,), dtypes=(torch.float64,))
    for text in ["ring_off_by_one", "world_size=3, length=9, float64", "rank 0", "wrong result",
                 "expected (torch on the same inputs)", "got:", "chunk(s) [", "max |error|"]:
        assert text in str(info.value), str(info.value)


def test_off_by_one_with_unequal_chunks_crashes_gloo_and_says_why():
    _fails(ring_off_by_one, ["ring_off_by_one", "world_size=3, length=7", "different sizes"], exc=minidist.LaunchError)


def test_missing_all_gather_is_a_wrong_result():
    _fails(ring_without_all_gather, ["wrong result", "of tensor_split(3)"])


def test_whole_tensor_each_step_fails_the_bytes_check():
    check_collective(ring_whole_tensor, "all_reduce", world_sizes=(3,), lengths=(7,))     # the answer is right ...
    _fails(ring_whole_tensor, ["communication pattern", "2(N-1)/N·S", "56 bytes sent", "whole tensor"],
           pattern="ring")                                                          # ... the traffic is not


def test_deadlock_fails_within_the_timeout_with_the_launchers_diagnosis():
    msg = _fails(ring_everyone_sends_first, ["ring_everyone_sends_first", "world_size=3, length=7", "send(dst="],
                 exc=minidist.LaunchError, timeout=2)
    assert "ring_everyone_sends_first" in msg


def test_calling_a_collective_or_minidist_is_forbidden():
    _fails(ring_calls_all_reduce, ["forbidden", "all_reduce is not allowed", "dist.send/recv/isend/irecv"])
    _fails(ring_calls_minidist, ["forbidden", "minidist.ring_all_reduce"])


def test_modifying_the_input_is_reported():
    _fails(ring_in_place, ["modified its input", "clone()"])


def test_pattern_checks_catch_right_answers_computed_the_wrong_way():
    _fails(naive_all_reduce_via_ring, ["rank 1", "sent to rank 0 (its whole tensor, once"], pattern="naive")
    _fails(halving_as_ring, ["2·lg N = 4 messages sent", "seen 6"], world_sizes=(4,), pattern="halving")


def test_broadcast_root_is_checked():
    with pytest.raises(AssertionError, match=r"broadcast_from_zero \(world_size=3, length=3, float32, root=1\): rank 0"):
        check_collective(broadcast_from_zero, "broadcast", world_sizes=(3,), lengths=(3,), dtypes=(torch.float32,))


def test_bad_arguments_to_the_checks():
    with pytest.raises(ValueError, match="unknown kind"):
        check_collective(ring_all_reduce, "allreduce")
    with pytest.raises(ValueError, match="unknown pattern"):
        check_collective(ring_all_reduce, "all_reduce", pattern="tree")


def test_lab1_halving_must_raise_value_error_on_non_power_of_two_world_sizes():
    def strict(tensor):
        n = dist.get_world_size()
        if n & (n - 1):
            raise ValueError(f"recursive halving needs a power-of-two world size, got {n}")
        return halving_all_reduce(tensor)

    rejects = lab1.REJECTS["recursive_halving_all_reduce"]
    run(rejects, strict, hidden=True)                                            # N = 6
    with pytest.raises(AssertionError, match=r"world_size=3\): ranks \[0, 1, 2\] returned instead of raising"):
        run(rejects, lambda t: t.clone(), hidden=False)
    lab1.check_recursive_halving_all_reduce(strict, hidden=True)      # N = 1 among the hidden sizes; N = 3 and 6 refused


# ----------------------------------------------------------------------------- diagnoses (issue 28 item 5)
def naive_from_any_source(tensor):
    """Right under gloo, rejected by NCCL: rank 0 receives without naming the sender."""
    rank, n = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    if rank == 0:
        for _ in range(n - 1):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming)
            total += incoming
        for peer in range(1, n):
            dist.send(total, dst=peer)
    else:
        dist.send(tensor, dst=0)
        dist.recv(total, src=0)
    return total


def test_a_receive_without_a_source_fails_because_nccl_has_none():
    _fails(naive_from_any_source, ["naive_from_any_source (world_size=2", "recv() without src",
                                   "NCCL has no receive from any source"], world_sizes=(2,))


def _two_cases_one_rank_skips(progress):
    from minidist.checks.kit.launch import mark_case
    rank = dist.get_rank()
    mark_case(progress, f"case {'A' if rank % 2 == 0 else 'B'}")
    x = torch.ones(4)
    if rank != 1:
        dist.all_reduce(x)
    return x


def test_a_failure_names_each_ranks_case_and_the_rank_that_skipped_a_collective():
    from minidist.checks.kit.launch import launch_named
    with pytest.raises(minidist.LaunchError) as info:
        launch_named(_two_cases_one_rank_skips, 3, name="skipper", timeout=10)
    message = str(info.value)
    assert "\n  rank 0 was running: case A\n  rank 1 was running: case B\n  rank 2 was running: case A" in message
    assert "rank 1 returned without calling all_reduce that its peers called at line" in message, message
    assert "test_checks_collectives.py" in message


def _rank_1_crashes_in_case_2_while_rank_0_goes_on(progress):
    from minidist.checks.kit.launch import mark_case
    for case in ("case 1", "case 2", "case 3"):
        mark_case(progress, case)
        if case == "case 2":
            if dist.get_rank() == 0:
                dist.send(torch.ones(4), 1)          # completes on rank 0's side: it goes on
            else:
                dist.recv(torch.empty(2), 0)         # 16 bytes where 8 were expected: gloo aborts
        if case == "case 3":
            dist.barrier()
    return 0


def test_a_crash_names_the_case_it_happened_in_even_when_a_peer_went_on():
    from minidist.checks.kit.launch import launch_named
    with pytest.raises(minidist.LaunchError) as info:
        launch_named(_rank_1_crashes_in_case_2_while_rank_0_goes_on, 2, name="crasher", timeout=10)
    message = str(info.value)
    assert message.startswith("crasher (world_size=2, case 2) (rank 0 had already finished this case) failed:"), message
    assert "different cases" not in message
    assert "rank 1: killed by signal SIGABRT" in message


def test_wrong_group_hint_names_a_sum_over_the_world():
    from minidist.checks.kit.groups import wrong_group_hint
    xs = [torch.full((3,), float(r + 1)) for r in range(4)]
    group, world = xs[0] + xs[1], sum(xs)
    assert "sum over all 4 ranks (the world), not over the 2 ranks" in wrong_group_hint(world, group, world, 2, 4)
    assert wrong_group_hint(group, group, world, 2, 4) == ""          # right: nothing to say
    assert wrong_group_hint(world + 1, group, world, 2, 4) == ""      # wrong some other way: no guess
    assert wrong_group_hint(world, world, world, 4, 4) == ""          # the group is the world


def test_notebook_frames_are_named_by_cell_title_and_minidists_frames_are_hidden():
    import linecache
    from minidist.runtime.rank_process import format_frame, student_frames
    from minidist.trace.errors import cell_title
    cell = "/tmp/ipykernel_123/456.py"
    source = "import torch\n\ndef ring_all_reduce(t):\n    x = t.clone()\n    return x\n"
    linecache.cache[cell] = (len(source), None, source.splitlines(True), cell)
    test_cell = "/tmp/ipykernel_123/789.py"
    linecache.cache[test_cell] = (20, None, ["checks.check_ring_all_reduce(ring)\n"], test_cell)
    try:
        assert cell_title(cell, 4) == 'notebook cell "ring_all_reduce"'
        assert format_frame(cell, 4, "ring_all_reduce").startswith('notebook cell "ring_all_reduce", line 4, in')
        assert cell_title(test_cell, 1) == 'notebook cell "checks.check_ring_all_reduce(ring)"'
    finally:
        del linecache.cache[cell], linecache.cache[test_cell]
    import minidist.tensor_parallel
    stand_in = minidist.tensor_parallel.__file__
    frames = [(stand_in, 10, "tp_mlp"), (cell, 4, "ring_all_reduce"), (torch.__file__, 1, "f")]
    assert student_frames(frames, filename=lambda f: f[0]) == [(cell, 4, "ring_all_reduce")]
    assert student_frames(frames[:1], filename=lambda f: f[0]) == frames[:1]     # minidist's own failure: kept
