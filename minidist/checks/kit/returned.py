"""What graded code returns must compare as it says: plain values, not objects of its own.

A check compares the student's results with its references after the graded call has returned,
outside the region where library answers are refused. A value of a class the graded code defined
runs that class's code in the comparison: a tensor subclass's ``__torch_function__`` sees every
operation the check applies to it (``(got - want).abs().max()``), and a number-like object's
``__float__`` or ``__eq__`` can answer whatever the check asks, computed with the library the
refusal kept out of the graded call (the "always equal" trick of autograders).

* :func:`own_tensor_subclass` finds a tensor of a subclass defined by student code in a returned
  value; :class:`~minidist.checks.kit.refusal.refusing` fails every graded call that returns one.
* :func:`not_plain_tensor` says why a value a check compares as a tensor is not a plain one, and
  :func:`tensor_problem` why it cannot be compared with a reference at all (None, not plain, another
  shape): the comparison helpers of labs 5, 6, 8 and 9 ask it before their own tolerance;
* :func:`foreign_part` finds anything that is not plain (numbers, strings, plain tensors,
  torch's dtypes and sizes, lists, tuples, dicts, and objects of minidist's own classes made of
  those); a pure check whose answer is such a value calls :func:`require_plain`, or records it with
  :func:`returned` for its verdict to ask :func:`returned_problem`.
"""
from __future__ import annotations

import sys

import torch

from minidist.checks.kit.student_code import is_student_code
from minidist.runtime.plain_data import found_where_it_says

_LEAVES = (int, float, bool, str, complex, bytes, type(None), torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SEQUENCES = (list, tuple, set, frozenset)
MAX_ITEMS = 100_000          # a returned structure is walked this far, no further


def _library_class(cls) -> bool:
    """A class an installed module defines, found where it says it is (``__module__`` is only a
    claim: a student's class may carry any)."""
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    return file is not None and not is_student_code(file) and found_where_it_says(cls)


def _walk(value):
    """Every element of ``value`` (containers and minidist objects opened), up to MAX_ITEMS."""
    stack, walked = [value], 0
    while stack and walked < MAX_ITEMS:
        v = stack.pop()
        walked += 1
        t = type(v)
        if t in _SEQUENCES or t.__module__ == "torch.return_types":
            stack.extend(v)
        elif t is dict:
            stack.extend(v.keys())
            stack.extend(v.values())
        elif _minidist_class(t) and hasattr(v, "__dict__"):
            stack.extend(vars(v).values())
        yield v


def _minidist_class(t) -> bool:
    return (t.__module__ or "").split(".")[0] == "minidist" and _library_class(t)


def own_tensor_subclass(value) -> str | None:
    """The name of a tensor subclass defined by student code found in ``value``, or None."""
    for v in _walk(value):
        if isinstance(v, torch.Tensor) and type(v) not in _TENSORS and not _library_class(type(v)):
            return type(v).__qualname__
    return None


def foreign_part(value) -> str | None:
    """What in ``value`` is not plain data ("a MyNumber"), or None."""
    for v in _walk(value):
        t = type(v)
        if t in _LEAVES or t in _TENSORS or t in _SEQUENCES or t is dict or t.__module__ in ("numpy", "torch.return_types"):
            continue
        if _minidist_class(t):
            continue
        return f"a {t.__qualname__}"
    return None


def _not_plain(label: str, part: str) -> str:
    return (f"{label} returned {part}: return plain values (numbers, tensors, lists, tuples, dicts), not objects "
            f"of your own (the check compares them outside the graded call)")


def require_plain(label: str, value) -> None:
    """AssertionError unless ``value`` is plain data (see :func:`foreign_part`)."""
    part = foreign_part(value)
    if part is not None:
        raise AssertionError(_not_plain(label, part))


def returned(value, call: str) -> dict:
    """An answer's record of the value ``call`` (as a failure names the call) returned: ``{"returned": value}``,
    or ``{"foreign": what in it is not plain data, "call": call}`` (its code would run in the verdict)."""
    part = foreign_part(value)
    return {"returned": value} if part is None else {"foreign": part, "call": call}


def returned_problem(answer) -> str | None:
    """The verdict on a :func:`returned` record before its value is read: what was not plain data, or that the
    answer is no such record; None when ``answer["returned"]`` is the value."""
    if not isinstance(answer, dict) or not ("returned" in answer or "foreign" in answer):
        return f"the answer is not the function's result ({type(answer).__name__})"
    return _not_plain(str(answer.get("call")), answer["foreign"]) if "foreign" in answer else None


def not_plain_tensor(what: str, got, shape=None) -> str | None:
    """Why ``got`` is not a plain tensor (None if it is): an object of another class, or a tensor
    subclass, would run its own code in the comparison that follows."""
    if type(got) in _TENSORS:
        return None
    if isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__qualname__}, a torch.Tensor subclass: return a plain tensor"
    return f"{what} is a {type(got).__name__}, expected a tensor" + (f" of shape {tuple(shape)}" if shape else "")


def tensor_problem(what: str, got, want) -> str | None:
    """Why ``got`` cannot be compared element by element with the tensor ``want`` (None if it can):
    it is None, not a plain tensor, or of another shape. Each lab's comparison then applies its
    own rule on dtype and tolerance."""
    if got is None:
        return f"{what} is None: no gradient reached it (was it detached, or built outside autograd?)"
    if problem := not_plain_tensor(what, got, want.shape):
        return problem
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return None
