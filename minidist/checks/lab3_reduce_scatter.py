"""Lab 3's check of ``reduce_scatter_gradients`` on one unit (ZeRO-2, Rajbhandari et al. 2019):
after two calls with per-rank, per-micro-batch gradients, ``unit.shard.grad`` on rank r is

    shard_r( Σ_micro (1/N) Σ_ranks flat_padded(grads) )

with a missing gradient counted as zeros at its place, every ``p.grad`` dropped, the parameters
untouched, and one ``reduce_scatter_tensor`` of the whole padded flat gradient per call. The
ranks return what they hold; this process computes the expected shards and compares, and so
does the grader's judge (the check is judged: :mod:`minidist.checks.kit.docket`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minidist.checks import lab3_grading as grading
from minidist.checks.kit.launch import TRAINING_CHECK_TIMEOUT, launch_named, mark_case, report_passed
from minidist.checks.kit.docket import Judged, from_raising, judged
from minidist.checks.kit.quiet import passes_quietly
from minidist.runtime import device
from minidist.trace import trace


def _local_grad(shape, rank, k, micro, dtype=torch.float32):
    """Rank ``rank``'s gradient of parameter ``k`` in micro-batch ``micro``, on the CPU: distinct everywhere."""
    g = torch.Generator(device="cpu").manual_seed(1000 * micro + 100 * rank + k)
    return torch.randn(shape, generator=g, dtype=dtype, device="cpu")


def _unit_body(progress, cases, reduce_scatter_gradients, ShardedUnit):
    """Give one module non-zero parameters and known, per-rank and per-micro-batch gradients
    (one of them missing), reduce-scatter twice, return the shard grad and what else changed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = device()          # the rank's device; the check compares on the CPU
    out = []
    for shapes, missing, dtype in cases:
        mark_case(progress, f"a unit of parameters {shapes} in {dtype}, parameter {missing} without a gradient")
        module = nn.Module()
        for k, s in enumerate(shapes):
            g = torch.Generator(device="cpu").manual_seed(k)
            module.register_parameter(f"p{k}", nn.Parameter(torch.randn(s, generator=g, dtype=dtype, device="cpu").to(dev)))
        unit = ShardedUnit(module, n, rank)
        before = [p.detach().clone() for p in unit.params]
        with trace() as t:
            for micro in range(2):              # two micro-batches: the second call must add
                for k, p in enumerate(unit.params):
                    p.grad = None if k == missing else _local_grad(p.shape, rank, k, micro, dtype).to(dev)
                reduce_scatter_gradients(unit)
        grads_left = [p.grad is not None for p in unit.params]
        shard_grad = None if unit.shard.grad is None else unit.shard.grad.clone()
        aliased = shard_grad is not None and (unit.shard.grad.untyped_storage().data_ptr()
                                              == unit.flat.untyped_storage().data_ptr())
        out.append({"shard_grad": shard_grad, "grads_left": grads_left, "aliased": aliased,
                    "params_kept": all(torch.equal(p.detach(), b) for p, b in zip(unit.params, before)),
                    "events": [(e.op, e.nbytes) for e in t.comm()], "padded": unit.layout.padded_numel,
                    "shard_numel": unit.layout.shard_numel})
    return out


F32, F64 = torch.float32, torch.float64


def _unit_cases(hidden: bool) -> list[tuple]:
    """(shapes, index of the parameter without a gradient: last, in the middle, none, first; dtype)"""
    return [([(3, 5), (7,)], 1, F32), ([(4,), (2, 2), (5,)], 1, F32)] + (
        [([(1,)], None, F32), ([(6, 7), (6,), (9,)], 0, F32), ([(5, 3), (4,)], None, F64)] if hidden else [])


def _compare(run, out) -> None:
    """Every rank's results of a run (n, cases) against the shards this process computes."""
    n, cases = run
    for i, (shapes, missing, dtype) in enumerate(cases):
        what = (f"reduce_scatter_gradients (world_size={n}, parameters {shapes}"
                + ("" if dtype == F32 else f" in {dtype}")
                + (f", parameter {missing} without a gradient)" if missing is not None else ")"))
        flats = []
        for r in range(n):
            for micro in range(2):
                flat = torch.cat([torch.zeros(s, dtype=dtype).reshape(-1) if k == missing else
                                  _local_grad(s, r, k, micro, dtype).reshape(-1) for k, s in enumerate(shapes)])
                flats.append(torch.cat([flat, torch.zeros(out[0][i]["padded"] - flat.numel(), dtype=dtype)]))
        mean = 2 * torch.stack(flats).mean(0)          # the sum over the micro-batches of the rank mean
        S = out[0][i]["shard_numel"]
        for r in range(n):
            res = out[r][i]
            if res["shard_grad"] is None:
                raise AssertionError(f"{what}: rank {r}: unit.shard.grad is None after the call")
            if not res["params_kept"]:
                raise AssertionError(f"{what}: rank {r}: the parameters changed; reduce_scatter_gradients must "
                                     f"leave them (and unit.flat, unit.shard) untouched: write the reduce-scatter's "
                                     f"output into a new tensor")
            want = mean[r * S:(r + 1) * S]
            if res["shard_grad"].dtype != dtype:
                raise AssertionError(f"{what}: rank {r}: unit.shard.grad is {res['shard_grad'].dtype}; the "
                                     f"parameters are {dtype}: make buffers like the shard (torch.empty_like, "
                                     f"like=unit.shard), not in the default dtype")
            if res["shard_grad"].shape != want.shape or not torch.allclose(res["shard_grad"], want, atol=1e-5):
                hint = ""
                if res["shard_grad"].shape == want.shape:
                    if torch.allclose(res["shard_grad"], n * want, atol=1e-5):
                        hint = " It is N times too large: divide the sum by the world size."
                    elif missing is not None and missing < len(shapes) - 1:
                        hint = (f" Parameter {missing} has no gradient: it must count as zeros AT ITS PLACE "
                                f"in the flat vector (unit.layout.flatten(..., like=unit.shard) does that).")
                    elif torch.allclose(res["shard_grad"], torch.stack(flats[1::2]).mean(0)[r * S:(r + 1) * S],
                                        atol=1e-5):
                        hint = (" It holds the second micro-batch's average only: a second call must ADD to "
                                "unit.shard.grad (gradient accumulation), not replace it.")
                raise AssertionError(f"{what}: rank {r}: after two calls (two micro-batches with different "
                                     f"gradients) unit.shard.grad should be the sum over both of the average over "
                                     f"ranks of shard {r} of the flat padded gradient.{hint}")
            if res["aliased"]:
                raise AssertionError(f"{what}: rank {r}: unit.shard.grad shares memory with the parameters "
                                     f"(unit.flat): the next call overwrites the parameters")
            if any(res["grads_left"]):
                raise AssertionError(f"{what}: rank {r}: p.grad is still set after the reduce-scatter; set it to "
                                     f"None so that the full gradient's memory is released")
            ops = [op for op, _ in res["events"]]
            if ops != ["reduce_scatter_tensor"] * 2:
                raise AssertionError(f"{what}: rank {r}: expected one reduce_scatter_tensor per call, saw {ops}")
            nbytes = res["padded"] * want.element_size()
            if any(b != nbytes for _, b in res["events"]):
                raise AssertionError(f"{what}: rank {r}: each reduce-scatter should take the whole padded flat "
                                     f"gradient ({nbytes} bytes), saw {[b for _, b in res['events']]}")


#: Judged (minidist.checks.kit.docket): the child files every rank's results; the grader's judge compares again.
JUDGED = Judged(__name__, "reduce_scatter_gradients",
                lambda hidden: [(n, _unit_cases(hidden)) for n in ((2, 3, 4) if hidden else (2,))],
                from_raising(_compare))


@judged(JUDGED)
@passes_quietly
def check_reduce_scatter_gradients(reduce_scatter_gradients, ShardedUnit, hidden: bool = False,
                                   timeout: float = TRAINING_CHECK_TIMEOUT) -> None:
    """On each rank, ``unit.shard.grad`` becomes (accumulates) the average over ranks of this
    rank's shard of the flat, padded gradient (a missing gradient counts as zeros); every
    full ``p.grad`` is dropped; one reduce_scatter_tensor of the padded flat gradient per call."""
    cases = _unit_cases(hidden)
    sizes = (2, 3, 4) if hidden else (2,)
    JUDGED.run(dict(hidden=hidden), lambda run: launch_named(
        _unit_body, run[0], run[1], reduce_scatter_gradients, ShardedUnit, name="reduce_scatter_gradients",
        timeout=timeout, refuse=grading.REFUSED))
    report_passed("reduce_scatter_gradients", f"N={', '.join(map(str, sizes))}, {len(cases)} units"
                  + (" in fp32/fp64" if hidden else "") + ": the accumulated shard gradient, parameters unchanged, "
                  "one reduce-scatter per call", hidden)
