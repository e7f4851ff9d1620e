"""minidist.checks_dp: the library's own implementations pass, typical mistakes fail with
a message that says what is wrong."""
import pytest
import torch
import torch.distributed as dist

from minidist import checks_dp
from minidist.data_parallel import BucketedDDP, NaiveDDP, make_buckets


def good_split(x, y, rank, world_size):
    if x.shape[0] % world_size:
        raise ValueError("uneven")
    n = x.shape[0] // world_size
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def test_split_check_accepts_contiguous_blocks_and_rejects_the_rest():
    checks_dp.check_split_batch(good_split, hidden=True)
    with pytest.raises(AssertionError, match="contiguous"):
        checks_dp.check_split_batch(lambda x, y, r, n: (x[r::n], y[r::n]))
    with pytest.raises(AssertionError, match="ValueError"):
        checks_dp.check_split_batch(lambda x, y, r, n: (x[r * (len(x) // n):(r + 1) * (len(x) // n)],
                                                        y[r * (len(x) // n):(r + 1) * (len(x) // n)]))


def test_bucket_check_accepts_the_library_and_rejects_forward_order():
    checks_dp.check_make_buckets(make_buckets, hidden=True)
    with pytest.raises(AssertionError, match="REVERSE"):
        checks_dp.check_make_buckets(lambda ps, cap: [list(b)[::-1] for b in make_buckets(ps, cap)][::-1])


def library_average(model):
    NaiveDDP(model, broadcast_from=None).sync_gradients()


def summed(model):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def test_average_checks_accept_the_library():
    checks_dp.check_average_gradients(library_average, hidden=True)
    checks_dp.check_average_gradients_traffic(library_average)


def test_average_checks_diagnose_a_missing_sync_and_a_missing_division():
    with pytest.raises(AssertionError, match="never synchronised"):
        checks_dp.check_average_gradients(lambda model: None)
    with pytest.raises(AssertionError, match="summed instead of averaged"):
        checks_dp.check_average_gradients(summed)
    with pytest.raises(AssertionError, match="only all_reduce"):
        checks_dp.check_average_gradients_traffic(lambda model: None)


def test_bucketed_checks_accept_the_library_ddp():
    # the library's BucketedDDP syncs at the end of backward; its finish_gradient_sync() is then a no-op
    checks_dp.check_bucketed_ddp(BucketedDDP, hidden=True)
    checks_dp.check_bucketed_ddp_traffic(BucketedDDP)
    checks_dp.check_overlap(BucketedDDP)


class SyncAfterBackward:
    """Right numbers, one all-reduce per bucket, but everything after backward."""

    def __init__(self, model, bucket_cap_bytes):
        self.model = model
        self.buckets = make_buckets([p for p in model.parameters() if p.requires_grad], bucket_cap_bytes)

    def __call__(self, x):
        return self.model(x)

    def finish_gradient_sync(self):
        n = dist.get_world_size()
        for b in self.buckets:
            for p in b:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in b]) / n
            dist.all_reduce(flat)
            offset = 0
            for p in b:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()


def test_overlap_check_rejects_sync_after_backward_but_equality_accepts_it():
    checks_dp.check_bucketed_ddp(SyncAfterBackward)
    checks_dp.check_bucketed_ddp_traffic(SyncAfterBackward)
    with pytest.raises(AssertionError, match="before backward produced its last gradient"):
        checks_dp.check_overlap(SyncAfterBackward)


def test_step_time_rows():
    rows = checks_dp.step_time_vs_bucket_size(BucketedDDP, [1024, 1 << 20], steps=2,
                                              model_kwargs={"hidden": 16})
    assert [r["cap"] for r in rows] == [1024, 1 << 20]
    assert rows[0]["buckets"] > rows[1]["buckets"] == 1 and all(r["step_ms"] > 0 for r in rows)
