"""The exercise ``train_resumable(model, optimizer, scaler, sampler, store, steps, every, group=None)`` of
lab 10: a training run that survives its ranks being killed. It resumes from ``store.latest()`` (model,
optimizer, loss scaler where there is one, torch's, Python's and numpy's random states, the sampler's
position), runs :func:`~.restart_kit.training_step` for the steps after it, saves after every
``every``-th step (labelled with the number of steps done) and returns the step it started from.

The answer (``answers.restarted``) launches it on 2 CPU ranks with ``max_restarts``, each attempt
building a fresh run the same way (:func:`~.restart_kit.new_run`, as a relaunched job does), and kills
a rank (``os._exit``) where a case says: while it draws the batch of step k, or inside ``store.save(s)``
after the file is written and before its rename. The verdict rebuilds the uninterrupted run here, in
one process: a plain loop of the same step, with no checkpoint at all, both ranks' generators swapped
in turn and their gradients summed as the all-reduce sums two (:func:`reference`); the killed run must
end equal to it bit for bit (weights, Adam's state, the scaler's, the sampler's position, every random
state), and must have resumed: the last attempt starts from the newest step every rank saved, and runs
only the steps after it. The hidden cases are the grader's."""
from __future__ import annotations

import contextlib
import hashlib
import random

import numpy as np
import torch

from minidist.checks.kit.launch import one_thread
from minidist.checks.kit.withheld import hidden_cases
from minidist.checks.lab10_checkpointing.restart_kit import apply_update, local_gradients, new_run

WORLD = 2
#: what a kill interrupts: ("step", rank, k) while rank draws the batch of step k (1-based); ("save", rank,
#: s) inside its store.save(s), the file written, not renamed. Kill i happens in attempt i (0-based).
KILLS = {"step": "killed at step {at} on rank {rank}", "save": "killed while saving step {at} on rank {rank}"}


def cases(hidden: bool) -> list[dict]:
    visible = [dict(steps=8, every=3, scaler=False, kills=()),
               dict(steps=8, every=3, scaler=True, kills=(("step", 1, 5), ("save", 0, 6)))]
    return visible + (hidden_cases(__package__, "train_resumable").RESTART if hidden else [])


def describe(case: dict) -> str:
    kills = ", then ".join(KILLS[k].format(rank=r, at=at) for k, r, at in case["kills"]) or "never killed"
    return (f"steps={case['steps']}, every={case['every']}, {'a loss scaler' if case['scaler'] else 'scaler=None'}, "
            f"{kills}")


def covered(hidden: bool) -> str:
    return ("2 ranks, the run uninterrupted (no scaler) and killed mid-step then mid-save, ending bit-identical to a "
            "plain loop (weights, Adam, loss scale, data position, torch/Python/numpy random states)"
            + ("; killed without a scaler, a kill in the first save, a resume at the end of an epoch" if hidden else ""))


def starts(case: dict) -> list[int]:
    """The step each attempt starts from: 0, then after each kill the newest step every rank had saved
    (a kill at step k or in the save of step k leaves the saves of the steps before k)."""
    every = case["every"]
    return [0] + [(at - 1) // every * every for _, _, at in case["kills"]]


def saves(case: dict, start: int) -> list[int]:
    """The steps a run that starts at ``start`` saves: every ``every``-th, after it."""
    return [s for s in range(case["every"], case["steps"] + 1, case["every"]) if s > start]


def rng_digests() -> dict[str, str]:
    """A SHA-256 of each generator's state (torch's CPU one, Python's, numpy's global one), as hex."""
    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()
    name, keys, pos, gauss, cached = np.random.get_state(legacy=True)
    return {"torch": sha(torch.get_rng_state().numpy().tobytes()), "python": sha(repr(random.getstate()).encode()),
            "numpy": sha(repr((name, keys.tolist(), pos, gauss, cached)).encode())}


def final_state(model, optimizer, scaler, sampler) -> dict:
    """What a run ends with, as plain data (tensors copied)."""
    opt = {f"{i}.{k}": (v.detach().clone() if isinstance(v, torch.Tensor) else v)
           for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optimizer": opt,
            "scaler": None if scaler is None else scaler.state_dict(), "sampler": sampler.state_dict(),
            "rng": rng_digests()}


@contextlib.contextmanager
def _own_generators():
    """The global generators of this process, put back afterwards (the verdict swaps the ranks' in)."""
    saved = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])


def reference(case: dict) -> list[dict]:
    """Each rank's :func:`final_state` after ``case["steps"]`` plain steps, never killed, never saved: both
    ranks in this process, each rank's generators swapped in for its half of the step, the gradients
    summed as the all-reduce of two ranks sums them (one addition, the same bits either way round)."""
    with one_thread(), _own_generators():
        runs = []
        for rank in range(WORLD):
            run = list(new_run(rank, WORLD, case["scaler"]))        # seeds this rank's generators
            runs.append(run + [(torch.get_rng_state(), random.getstate(), np.random.get_state())])
        for _ in range(case["steps"]):
            for run in runs:
                model, _, scaler, sampler, states = run
                torch.set_rng_state(states[0])
                random.setstate(states[1])
                np.random.set_state(states[2])
                local_gradients(model, scaler, sampler.next_batch())
                run[4] = torch.get_rng_state(), random.getstate(), np.random.get_state()
            sums = [a.grad + b.grad for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters())]
            for model, optimizer, scaler, _, _ in runs:
                for p, g in zip(model.parameters(), sums):
                    p.grad = g.clone()
                apply_update(model, optimizer, scaler, WORLD)
        out = []
        for model, optimizer, scaler, sampler, states in runs:
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])
            out.append(final_state(model, optimizer, scaler, sampler))
        return out


#: what differs, in the order a cause shows first: (part, what it is, how a resume gets it back)
PARTS = (("sampler", "the data position (sampler.state_dict())", "sampler.state_dict() / sampler.load_state_dict()"),
         ("torch", "torch's random state (the dropout masks)", "torch.get_rng_state() / torch.set_rng_state()"),
         ("python", "Python's random state (the flips)", "random.getstate() / random.setstate()"),
         ("numpy", "numpy's random state (the noise)", "np.random.get_state() / np.random.set_state()"),
         ("scaler", "the loss scaler's state", "scaler.state_dict() / scaler.load_state_dict()"),
         ("optimizer", "Adam's state", "optimizer.state_dict() / optimizer.load_state_dict()"),
         ("weights", "the weights", "model.state_dict() / model.load_state_dict()"))


def _tensors_problem(what: str, got, want: dict) -> str | None:
    if not isinstance(got, dict) or sorted(got) != sorted(want):
        return f"{what} holds {sorted(got) if isinstance(got, dict) else got!r}; expected {sorted(want)}"
    for k, w in want.items():
        g = got[k]
        if not isinstance(w, torch.Tensor):
            if g != w:
                return f"{what} ({k}) is {g!r}, the uninterrupted run's {w!r}"
        elif not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.shape != w.shape:
            return f"{what} ({k}) is {_shown(g)}, the uninterrupted run's {_shown(w)}"
        elif not torch.equal(g, w):
            if w.numel() == 1:
                return f"{what} ({k}) is {g.item():g}, the uninterrupted run's {w.item():g}"
            err = (g.double() - w.double()).abs().max().item()
            return f"{what} ({k}) differs from the uninterrupted run's (max |error| {err:.3g}; bit-identical expected)"
    return None


def _shown(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)}"
    return repr(t)


def _dict_problem(what: str, got, want) -> str | None:
    if got == want:
        return None
    if not (isinstance(got, dict) and isinstance(want, dict) and sorted(got) == sorted(want)):
        return f"{what} is {got!r}, the uninterrupted run's {want!r}"
    keys = [k for k in want if got[k] != want[k]]
    show = lambda d: ", ".join(f"{k}={d[k]!r}" for k in keys)      # noqa: E731
    return f"{what} has {show(got)}, the uninterrupted run's {show(want)}"


def state_problem(got: dict, want: dict, killed: bool) -> str | None:
    for part, what, how in PARTS:
        if part in ("weights", "optimizer"):
            problem = _tensors_problem(what, got.get(part), want[part])
        elif part in ("sampler", "scaler"):
            problem = _dict_problem(what, got.get(part), want[part])
        else:
            problem = None if (got.get("rng") or {}).get(part) == want["rng"][part] else f"{what} differs from the uninterrupted run's"
        if problem:
            fix = (f"each checkpoint (labelled n, saved after step n) must hold it, and a resume restore it ({how})"
                   if killed else "even without a kill: run training_step once per step, on sampler.next_batch(), and "
                   "draw no random number of your own")
            return f"{problem}: {fix}"
    return None


def verdict(case, answer) -> str | None:
    label = f"train_resumable ({describe(case)})"
    if not isinstance(answer, dict):
        return f"{label}: no answer ({type(answer).__name__})"
    if "error" in answer:       # the launch's report, which names the case and the attempt already
        error = str(answer["error"])
        return error if error.startswith("train_resumable (") else f"{label}: {error}"
    kills, steps = case["kills"], case["steps"]
    if answer["killed"] != len(kills):
        missed = kills[answer["killed"]]
        doing = f"draw the batch of step {missed[2]}" if missed[0] == "step" else f"call store.save({missed[2]}, ...)"
        return (f"{label}: the run was to be killed {len(kills)} times, it was {answer['killed']}: run "
                f"{answer['killed'] + 1} never came to {doing} on rank {missed[1]} (resume from store.latest(), "
                f"and save after every every-th step)")
    start, ranks = starts(case)[-1], answer["ranks"]
    if not isinstance(ranks, list) or len(ranks) != WORLD:
        return f"{label}: {len(ranks) if isinstance(ranks, list) else 'no'} ranks answered, the launch had {WORLD}"
    want = reference(case)
    after = "after the last restart " if kills else ""
    for rank, (got, ref) in enumerate(zip(ranks, want)):
        at = f"{label}, rank {rank}"
        if got["forwards"] != steps - start:
            if kills and got["forwards"] == steps:
                return (f"{at}: {after}it ran all {steps} steps again from step 0; the newest checkpoint every rank "
                        f"had saved was step {start}: resume from store.latest()")
            if not kills:
                return f"{at}: it ran {got['forwards']} training steps; expected steps={steps}, one training_step each"
            return (f"{at}: {after}it ran {got['forwards']} training steps; from step {start} to steps={steps} "
                    f"there are {steps - start}: a checkpoint labelled s holds the state after s steps, resume with "
                    f"step s + 1")
        if got["returned"] != start:
            return (f"{at}: it returned {got['returned']!r}; expected {start}, the step it started from (0 on a fresh "
                    f"start, else the step of the checkpoint it resumed from)")
        if got["saved"] != saves(case, start):
            return (f"{at}: {after}it saved the steps {got['saved']}; expected {saves(case, start)} (store.save(s, "
                    f"state) once s steps are done, for every s divisible by every={case['every']})")
        if problem := state_problem(got, ref, bool(kills)):
            return f"{at}: {problem}"
    return None
