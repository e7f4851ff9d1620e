"""The exercise ``AsyncSaver(write)`` of lab 10: an asynchronous save. ``save(state, *args)`` waits
for the previous save (raising its error, if it failed), copies every tensor of ``state`` to host
memory, starts a thread that runs ``write(copy, *args)`` and returns at once; ``wait()`` waits for
the running save and raises, once, the error it ended with. The answer (``answers.async_saved``)
runs a scenario with a ``write`` of the check's own that records what it was given, when, and how
many writes ran at once; it is released only after ``save`` returned, and the state's tensors are
changed right after the call, as the next training step would. The hidden cases are the grader's."""
from __future__ import annotations

import torch

from minidist.checks.kit.compare import seeded, tensor_error
from minidist.checks.kit.withheld import hidden_cases

#: scenario -> what it checks (the ✓ line)
SCENARIOS = {"one": "returns before the write ends; the tensors written are the state at the call, though the "
                    "state changes right after it",
             "two": "a second save waits for the first: one write at a time, in order",
             "fails": "a write that fails: wait() raises its error, once",
             "fails_then_save": "a write that fails: the next save raises its error and starts no write"}
SHAPES = {"w": (4, 3), "b": (4,)}


def cases(hidden: bool) -> list[dict]:
    visible = [dict(scenario="one", seed=30), dict(scenario="two", seed=31), dict(scenario="fails", seed=32)]
    return visible + (hidden_cases(__package__, "async_saver").ASYNC if hidden else [])


def covered(hidden: bool) -> str:
    return "; ".join(SCENARIOS[c["scenario"]] for c in cases(hidden))


def state_of(case: dict, k: int = 0) -> dict[str, torch.Tensor]:
    """The state of the k-th save of a case (CPU tensors: this process stands for a rank)."""
    return {name: seeded(shape, case["seed"] + 10 * k + i, case.get("dtype", torch.float32))
            for i, (name, shape) in enumerate(SHAPES.items())}


def verdict(case, answer) -> str | None:
    label = f"AsyncSaver ({SCENARIOS[case['scenario']]})"
    if "error" in answer:
        return f"{label}: {answer['error']}"
    if answer.get("max_active", 0) > 1:
        return f"{label}: {answer['max_active']} writes ran at once; a save waits for the previous one first"
    if case["scenario"] in ("one", "two"):
        if not answer["returned_early"]:
            return f"{label}: save() returned only after the write ended; start the write on a thread and return"
        saves = 1 if case["scenario"] == "one" else 2
        if answer["args"] != [[f"step_{k}"] for k in range(saves)]:
            return f"{label}: the writes were called with the arguments {answer['args']}; expected write(copy, *args)"
        for k in range(saves):
            got, want = answer["written"][k], state_of(case, k)
            if sorted(got) != sorted(want):
                return f"{label}: save #{k + 1} wrote {sorted(got)}; the state holds {sorted(want)}"
            for name, t in want.items():
                if problem := tensor_error(f"{name} of save #{k + 1}", got[name], t, tol=0.0,
                                           against="the state at the call"):
                    return (f"{label}: {problem}; the state changed right after save() returned: copy it "
                            "(a new tensor in host memory) before save() returns")
            if answer["same_storage"][k]:
                return f"{label}: save #{k + 1} wrote the state's own tensors; copy them to host memory"
        if answer["waited"] is not None:
            return f"{label}: wait() raised {answer['waited']} after a save that succeeded"
        return None
    raised = answer["raised"]
    if raised is None:
        where = "wait()" if case["scenario"] == "fails" else "the next save()"
        return f"{label}: the write failed in the background, but {where} did not raise its error"
    if raised != {"type": "OSError", "message": answer["failure"]}:
        return f"{label}: raised {raised['type']}: {raised['message']!r}; expected the write's own OSError"
    if case["scenario"] == "fails" and answer["again"] is not None:
        return f"{label}: a second wait() raised {answer['again']} again; raise a failure once"
    if case["scenario"] == "fails_then_save" and answer["writes"] != 1:
        return f"{label}: {answer['writes']} writes started; the save after a failure must raise before writing"
    return None
