"""The exercise ``checkpoint_interval(save_s, gpu_mtbf_s, gpus)`` of lab 10: how often to save. It
returns ``{"mtbf_s": M, "young_s": ..., "daly_s": ...}``: the job's MTBF from the per-GPU one
(M = M_gpu / N), Young's interval √(2·C·M) (1974) and Daly's (2006; M itself when C >= 2M), each
checked against :mod:`minidist.cost.checkpoint` (refused while the student's code runs; the verdict
runs after it). The answer is the kit's ``called``; the hidden cases are the grader's, in ``hidden.py``."""
from __future__ import annotations

import math

from minidist.checks.kit.withheld import hidden_cases
from minidist.cost.checkpoint import daly_interval, job_mtbf, young_interval

KEYS = ("mtbf_s", "young_s", "daly_s")
REL = 1e-9
HOUR = 3600.0


def cases(hidden: bool) -> list[dict]:
    """``args``: (save seconds C, per-GPU MTBF in seconds, GPUs N)."""
    visible = [dict(args=(60.0, 3.1 * HOUR * 16384, 16384)),       # Llama 3's scale: M about 3.1 hours
               dict(args=(30.0, 5.0e6, 1024))]
    return visible + (hidden_cases(__package__, "checkpoint_interval").INTERVAL if hidden else [])


def describe(case: dict) -> str:
    c, m, n = case["args"]
    return f"C = {c:g} s, per-GPU MTBF {m / HOUR:g} h, {n} GPUs"


def covered(hidden: bool) -> str:
    return "; ".join(describe(c) for c in cases(hidden))


def reference(case: dict) -> dict:
    c, m_gpu, n = case["args"]
    m = job_mtbf(m_gpu, n)
    return {"mtbf_s": m, "young_s": young_interval(c, m), "daly_s": daly_interval(c, m)}


def _cause(key: str, got: float, case: dict) -> str:
    """'; likely cause: ...' when ``got`` equals a classic mistake's value."""
    c, m_gpu, n = case["args"]
    m = m_gpu / n
    x = c / (2 * m)
    mistakes = {"the per-GPU MTBF, not the job's (M = M_gpu / N)": reference(dict(args=(c, m_gpu, 1)))[key],
                "√(C·M) (Young's interval is √(2·C·M))": math.sqrt(c * m),
                "Daly's formula without its final − C": math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9),
                "Daly's formula where C >= 2M (Daly's optimum is M itself there)":
                    math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c}
    for why, value in mistakes.items():
        if math.isclose(got, value, rel_tol=REL) and not math.isclose(value, reference(case)[key], rel_tol=REL):
            return f"; likely cause: {why}"
    return ""


def verdict(case, answer) -> str | None:
    label = f"checkpoint_interval({', '.join(f'{a:g}' for a in case['args'])})"
    if not isinstance(answer, dict) or sorted(answer) != sorted(KEYS):
        shown = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        return f"{label} returned {shown}; return a dict with the keys {list(KEYS)}"
    want = reference(case)
    for key in KEYS:
        got = answer[key]
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return f"{label}[{key!r}] is a {type(got).__name__}; it is a number of seconds"
        if not math.isclose(got, want[key], rel_tol=REL):
            return f"{label}[{key!r}] = {got!r}; expected {want[key]!r}{_cause(key, got, case)}"
    return None
