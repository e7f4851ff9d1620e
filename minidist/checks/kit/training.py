"""Training a student's data-parallel code, and comparing it with one process.

Shared by the checks of labs 2 and 3: the student's function or class is wrapped in a
:class:`minidist.harness.data_parallel.Trainer` and trained by the one data-parallel loop
(:func:`minidist.harness.data_parallel.train`), so the checks, the tests and the tour all
train the same way. Equality is with :func:`minidist.models.train_reference` on the whole
batch; when it fails, the message says which usual mistake the parameters match.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.launch import TOL, launch_named, mark_case, one_thread
from minidist.harness.data_parallel import Trainer, train
from minidist.models import TinyMLP, describe_mlp, flat_parameters, make_optimizer, train_reference


def student_trainer(kind: str, impl, cap: int | None = None, stage: int | None = None,
                    optimizer: str = "sgd", lr: float = 1e-2):
    """A factory ``(model, group) -> Trainer`` around the student's code.

    ``average_gradients``: ``impl(model)`` after every backward, with the reference optimizer;
    ``bucketed_ddp``: ``impl(model, bucket_cap_bytes=cap)``, ``finish_gradient_sync()`` after
    backward; ``zero``: lab 3's ``impl(model, stage, optimizer=, lr=)`` wrapper.
    """
    def make(model, group) -> Trainer:
        if kind == "average_gradients":
            opt = make_optimizer(model.parameters(), optimizer, lr)
            return Trainer(model, opt.step, opt.zero_grad, opt, after_backward=lambda: impl(model))
        if kind == "bucketed_ddp":
            ddp = impl(model, bucket_cap_bytes=cap)
            opt = make_optimizer(model.parameters(), optimizer, lr)
            return Trainer(ddp, opt.step, opt.zero_grad, opt, after_backward=ddp.finish_gradient_sync,
                           extra={"buckets": len(getattr(ddp, "buckets", []))})
        if kind == "zero":
            z = impl(model, stage, optimizer=optimizer, lr=lr)
            return Trainer(z, z.step, z.zero_grad, z.optimizer, after_backward=z.finish_backward,
                           state_tensors=z.state_tensors, full_parameters=z.full_parameters)
        raise ValueError(f"unknown kind {kind!r}")
    return make


def describe_case(case: dict) -> str:
    text = f"{describe_mlp(case['model_kwargs'])}, {case['steps']} {case.get('optimizer', 'sgd')} steps"
    if case.get("cap") is not None:
        text += f", bucket_cap_bytes={case['cap']}"
    if case.get("stage") is not None:
        text = f"stage {case['stage']}, " + text
    return text


def _train_body(progress, cases, kind, impl):
    out = []
    for case in cases:
        mark_case(progress, describe_case(case))
        make = student_trainer(kind, impl, case.get("cap"), case.get("stage"), case.get("optimizer", "sgd"))
        out.append(train(make, case["model_kwargs"], case["steps"], case["batch"], measure=case.get("measure", False)))
    return out


def train_student(kind: str, impl, world_size: int, cases: list[dict], name: str, timeout: float,
                  refuse=None) -> list:
    """Every case trained on ``world_size`` ranks in one launch: per rank, a list of
    :func:`~minidist.harness.data_parallel.train` results. ``refuse``: the lab's
    :class:`~minidist.checks.kit.launch.Refusal` (library answers fail the check)."""
    return launch_named(_train_body, world_size, cases, kind, impl, name=name, timeout=timeout, refuse=refuse)


def _reference(case, **wrong) -> torch.Tensor:
    model = TinyMLP(**case["model_kwargs"])
    return flat_parameters(train_reference(model, case["steps"], case["batch"],
                                           optimizer=case.get("optimizer", "sgd"), **wrong))


def check_equal(name: str, world_size: int, cases: list[dict], out: list, diagnose: bool = True) -> None:
    """Every rank's final parameters equal single-process training (NaN fails), and the
    replicas are identical; ``diagnose`` names the usual mistake a mismatch matches."""
    n = world_size
    with one_thread():
        for i, case in enumerate(cases):
            ref = _reference(case)
            what = f"{name} (world_size={n}, {describe_case(case)})"
            for r in range(n):
                got = out[r][i]["params"]
                err = (got - ref).abs().max().item()
                if err <= TOL:
                    continue
                hint = ""
                if diagnose and (got - _reference(case, only_slice=(r, n))).abs().max().item() < TOL:
                    hint = (" The parameters equal training on this rank's slice alone: the gradients were "
                            "never synchronised.")
                elif diagnose and any((got - _reference(case, loss_scale=s)).abs().max().item() < TOL
                                      for s in (n, 1 / n)):
                    hint = (" The parameters equal training with gradients summed instead of averaged"
                            " (or averaged twice): check the division by the world size.")
                raise AssertionError(f"{what}: rank {r}'s parameters differ from single-process training on "
                                     f"the whole batch, max |error| = {err:.3g} (tolerance {TOL:g}).{hint}")
            if any(not torch.equal(out[r][i]["params"], out[0][i]["params"]) for r in range(n)):
                raise AssertionError(f"{what}: the ranks ended with different parameters; after every step all "
                                     f"replicas must be identical (every rank must apply the same averaged gradient)")
