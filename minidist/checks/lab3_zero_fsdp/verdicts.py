"""Lab 3's verdicts: ``reduce_scatter_gradients``' shard gradient against the one computed here, each
ZeRO stage's training against one process (:mod:`minidist.checks.kit.training`), its measured memory
against the ZeRO formula (:func:`minidist.cost.zero_memory_bytes_fp32`) and the lab's reference, and
its traced traffic against the ring model (:func:`minidist.cost.ring_wire_bytes`)."""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import first, seeded, tensor_error, unchanged
from minidist.checks.kit.training import equal_problem
from minidist.checks.lab3_zero_fsdp.cases import F32, LIVE_SLACK, LIVE_WORLD, STEP_SLACK, grad_seed, graded, param_seed
from minidist.cost import ring_wire_bytes, zero_memory_bytes_fp32


# ----------------------------------------------------------------------------- reduce_scatter_gradients
def _flat_grads(shapes, missing, dtype, rank: int, micro: int, padded: int) -> torch.Tensor:
    """Rank ``rank``'s flat, padded gradient in micro-batch ``micro`` (the missing one as zeros, at its place)."""
    flat = torch.cat([torch.zeros(s, dtype=dtype).reshape(-1) if k == missing else
                      seeded(s, grad_seed(rank, k, micro), dtype).reshape(-1) for k, s in enumerate(shapes)])
    return torch.cat([flat, torch.zeros(padded - flat.numel(), dtype=dtype)])


def _unit(n: int, shapes, missing, dtype, answers: list) -> str | None:
    what = (f"reduce_scatter_gradients (world_size={n}, parameters {shapes}"
            + ("" if dtype == F32 else f" in {dtype}")
            + (f", parameter {missing} without a gradient)" if missing is not None else ")"))
    padded, S = answers[0]["padded"], answers[0]["shard_numel"]
    flats = [_flat_grads(shapes, missing, dtype, r, micro, padded) for r in range(n) for micro in range(2)]
    mean = 2 * torch.stack(flats).mean(0)          # the sum over the micro-batches of the rank mean
    second = torch.stack(flats[1::2]).mean(0)      # the second micro-batch's rank mean alone
    for r, res in enumerate(answers):
        got, want = res["shard_grad"], mean[r * S:(r + 1) * S]
        if got is None:
            return f"{what}: rank {r}: unit.shard.grad is None after the call"
        for k, s in enumerate(shapes):
            if problem := unchanged(f"parameter {k}", res["params"][k], seeded(s, param_seed(k), dtype),
                                    "reduce_scatter_gradients"):
                return (f"{what}: rank {r}: {problem}; it must leave the parameters (and unit.flat, unit.shard) "
                        f"untouched: write the reduce-scatter's output into a new tensor")
        if isinstance(got, torch.Tensor) and got.dtype != dtype:
            return (f"{what}: rank {r}: unit.shard.grad is {got.dtype}; the parameters are {dtype}: make buffers "
                    f"like the shard (torch.empty_like, like=unit.shard), not in the default dtype")
        if problem := tensor_error("unit.shard.grad", got, want):
            hint, comparable = "", isinstance(got, torch.Tensor) and got.shape == want.shape
            if comparable and tensor_error("", got, n * want) is None:
                hint = " It is N times too large: divide the sum by the world size."
            elif comparable and missing is not None and missing < len(shapes) - 1:
                hint = (f" Parameter {missing} has no gradient: it must count as zeros AT ITS PLACE in the flat "
                        f"vector (unit.layout.flatten(..., like=unit.shard) does that).")
            elif comparable and tensor_error("", got, second[r * S:(r + 1) * S]) is None:
                hint = (" It holds the second micro-batch's average only: a second call must ADD to "
                        "unit.shard.grad (gradient accumulation), not replace it.")
            return (f"{what}: rank {r}: after two calls (two micro-batches with different gradients) "
                    f"unit.shard.grad should be the sum over both of the average over ranks of shard {r} of the "
                    f"flat padded gradient: {problem}.{hint}")
        if res["aliased"]:
            return (f"{what}: rank {r}: unit.shard.grad shares memory with the parameters (unit.flat): the next "
                    f"call overwrites the parameters")
        if any(res["grads_left"]):
            return (f"{what}: rank {r}: p.grad is still set after the reduce-scatter; set it to None so that the "
                    f"full gradient's memory is released")
        ops = [op for op, _ in res["events"]]
        if ops != ["reduce_scatter_tensor"] * 2:
            return f"{what}: rank {r}: expected one reduce_scatter_tensor per call, saw {ops}"
        nbytes = padded * want.element_size()
        if any(b != nbytes for _, b in res["events"]):
            return (f"{what}: rank {r}: each reduce-scatter should take the whole padded flat gradient ({nbytes} "
                    f"bytes), saw {[b for _, b in res['events']]}")
    return None


def unit(case, answers) -> str | None:
    """Every unit of a launch ``(world size, units)``, on every rank, against the shards computed here."""
    n, units = case
    return first(_unit(n, shapes, missing, dtype, [a[i] for a in answers])
                 for i, (shapes, missing, dtype) in enumerate(units))


# ----------------------------------------------------------------------------- Zero
def zero(case, answers) -> str | None:
    """Every rank's parameters after training equal one process's (no diagnosis: the stand-ins decide)."""
    stage, n, cases = case
    return equal_problem(graded(stage), n, cases, answers, diagnose=False)


_FULL = {"optimizer": 8, "grads": 4, "params": 4}        # bytes per parameter of each state, unsharded
_MEMORY_HINT = {"optimizer": "Is the optimizer built over the shards only?",
                "grads": "Full gradients must be dropped (p.grad = None) once reduce-scattered.",
                "params": "Gathered parameters must be freed (storage resized to 0) after use: after each unit's "
                          "forward, and again after its backward."}


def _memory_rank(stage: int, n: int, slack: float, r: int, res: dict) -> str | None:
    head = f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}"
    formula = zero_memory_bytes_fp32(stage, res["numel"], n)
    states = [("optimizer", "memory", "optimizer states (Adam's two moments)")]
    if stage >= 2:
        states.append(("grads", "memory_after_backward", "gradients after backward"))
    if stage >= 3:
        states.append(("params", "memory", "parameters after the step"))
        states.append(("params", "memory_after_forward", "parameters between forward and backward"))
    for key, when, label in states:
        got, want = res[when][key], formula[key]
        if got > (1 + slack) * want:
            return (f"{head}: {label} hold {got} bytes; the formula says {want:.0f} (1/{n} of "
                    f"{_FULL[key] * res['numel']}), measured from live storages. {_MEMORY_HINT[key]}")
    psi_bytes = 4 * res["numel"]
    temporaries = res["step_temporaries"]
    if temporaries is not None and temporaries > psi_bytes / n + STEP_SLACK * psi_bytes:
        return (f"{head}: sharded_step created {temporaries} bytes of tensors that were alive at once "
                f"({temporaries / psi_bytes:.2f}× the parameters' {psi_bytes} bytes), outside optimizer.step(); at "
                f"most a copy of this rank's shards (1/{n}) + {STEP_SLACK}× is allowed. All-gather unit by unit "
                f"straight into unit.flat: one buffer for every unit's parameters (a coalesced all-gather), or a "
                f"full-size buffer per unit kept to the end, is a second full copy of the model, the memory ZeRO "
                f"removes.")
    extra = res["live_bytes"] - res["reference_live"] if n == LIVE_WORLD else 0
    if extra > LIVE_SLACK * psi_bytes:
        return (f"{head}: throughout a training step (forward, backward, optimizer step) the rank holds {extra} "
                f"bytes more than the lab's reference ({extra / psi_bytes:.2f}× the parameters' {psi_bytes} bytes; "
                f"at most {LIVE_SLACK}× is allowed), counting every live tensor on the rank's device. Something "
                f"model-sized is kept from one step to the next: a buffer of full size per unit (of gradients or "
                f"parameters, kept for reuse) is the unsharded copy ZeRO removes.")
    return None


def memory(case, answers) -> str | None:
    """Model states within ``slack`` of the ZeRO formula; sharded_step's temporaries; at N = 2, the bytes
    held through a step next to the lab's reference measured on the same rank."""
    stage, n, slack = case
    return first(_memory_rank(stage, n, slack, r, res) for r, res in enumerate(answers))


def traffic(case, answers) -> str | None:
    """Stages 1-2: reduce-scatter + all-gather of Ψ, 2(N−1)/N·Ψ wire bytes (DDP's); stage 3: two
    all-gathers and one reduce-scatter, 3(N−1)/N·Ψ."""
    stage, n, _ = case
    for r in range(n):
        res = answers[r][0]
        psi = 4 * res["numel"]
        traced: dict = {}
        for op, b in res["events"]:
            # either all-gather fills the flat buffer: the tensor form, or the list form into its chunk
            # views (the tracer counts the input shard of both)
            op = "all_gather_into_tensor" if op == "all_gather" else op
            traced[op] = traced.get(op, 0) + b
        what = f"{graded(stage)} (world_size={n}, Ψ={res['numel']}), rank {r}, one step"
        if set(traced) != {"reduce_scatter_tensor", "all_gather_into_tensor"}:
            return (f"{what}: expected only reduce_scatter_tensor and all-gathers (all_gather_into_tensor or "
                    f"all_gather), saw {sorted({op for op, _ in res['events']}) or 'no communication'}")
        rs, ag = traced["reduce_scatter_tensor"], traced["all_gather_into_tensor"]
        gathers = 2 if stage == 3 else 1
        pad = 4 * 16 * n                     # at most N-1 padding elements per unit
        if not psi <= rs <= psi + pad:
            return (f"{what}: reduce-scattered {rs} bytes; expected the padded gradient, Ψ·4 = {psi} (+ padding), "
                    f"once per step")
        if abs(ag * n - gathers * rs) > 0:
            return (f"{what}: all-gathered {ag} bytes of shards (= {ag * n} bytes of parameters); expected "
                    f"{gathers}× the parameters ({gathers * rs} bytes)"
                    + (": once before forward and once before backward" if stage == 3 else
                       ": once, after the sharded optimizer step"))
        wire = sum(ring_wire_bytes(op, b, n) for op, b in traced.items())
        factor = 3 if stage == 3 else 2
        if abs(wire / psi - factor * (n - 1) / n) > 0.05:
            return f"{what}: {wire:.0f} wire bytes; expected {factor}(N−1)/N·Ψ·4"
    return None
