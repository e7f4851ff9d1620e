"""Training a student's data-parallel code, and comparing it with one process.

Shared by the checks of labs 2 and 3: the student's function or class is wrapped in a
:class:`minidist.harness.data_parallel.Trainer` and trained by the one data-parallel loop
(:func:`minidist.harness.data_parallel.train`), so the checks, the tests and the tour all
train the same way. An answer trains its cases on a rank (:func:`trained`); a verdict compares
every rank's parameters with :func:`minidist.models.train_reference` on the whole batch
(:func:`equal_problem`) and, when they differ, says which usual mistake they match.
"""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import tensor_error
from minidist.checks.kit.launch import TOL, one_thread
from minidist.checks.kit.run import mark
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


def trained(kind: str, impl, cases: list[dict]) -> list[dict]:
    """Inside a rank (an answer): every case trained with the student's ``impl``, each marked as it
    starts; per case, the :func:`~minidist.harness.data_parallel.train` result."""
    out = []
    for case in cases:
        mark(describe_case(case))
        make = student_trainer(kind, impl, case.get("cap"), case.get("stage"), case.get("optimizer", "sgd"))
        out.append(train(make, case["model_kwargs"], case["steps"], case["batch"], measure=case.get("measure", False)))
    return out


def _reference(case, **wrong) -> torch.Tensor:
    model = TinyMLP(**case["model_kwargs"])
    return flat_parameters(train_reference(model, case["steps"], case["batch"],
                                           optimizer=case.get("optimizer", "sgd"), **wrong))


def _matches(got, want) -> bool:
    return tensor_error("the parameters", got, want, tol=TOL) is None


def equal_problem(name: str, world_size: int, cases: list[dict], per_rank: list, diagnose: bool = True) -> str | None:
    """Why the parameters every rank trained (``per_rank[r][i]``: :func:`trained`'s result for case i)
    are not those of single-process training on the whole batch (NaN fails), or why the replicas
    differ; None when neither. ``diagnose`` names the usual mistake a mismatch matches."""
    n = world_size
    with one_thread():
        for i, case in enumerate(cases):
            ref = _reference(case)
            what = f"{name} (world_size={n}, {describe_case(case)})"
            for r in range(n):
                got = per_rank[r][i]["params"]
                problem = tensor_error(f"rank {r}'s parameter vector", got, ref, tol=TOL,
                                       against="single-process training on the whole batch")
                if problem is None:
                    continue
                hint = ""
                if diagnose and _matches(got, _reference(case, only_slice=(r, n))):
                    hint = (" The parameters equal training on this rank's slice alone: the gradients were "
                            "never synchronised.")
                elif diagnose and any(_matches(got, _reference(case, loss_scale=s)) for s in (n, 1 / n)):
                    hint = (" The parameters equal training with gradients summed instead of averaged"
                            " (or averaged twice): check the division by the world size.")
                return f"{what}: {problem}.{hint}"
            if any(not torch.equal(per_rank[r][i]["params"], per_rank[0][i]["params"]) for r in range(n)):
                return (f"{what}: the ranks ended with different parameters; after every step all replicas "
                        f"must be identical (every rank must apply the same averaged gradient)")
    return None
