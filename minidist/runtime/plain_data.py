"""How a rank's return value travels back to ``launch``: as plain data, never as a pickle.

A rank runs code its launcher does not trust: in the labs and the grader, the student's. Were
its result a pickle, loading it would run whatever the rank wrote (``__reduce__`` may name any
callable, ``exec`` included) in the process that launched it, the one holding the checks and,
in the grader, the channel its verdict goes out on. So a result is written as JSON of a small
set of types, and reading it builds only those types, whatever the file holds:

* ``None``, ``bool``, ``int``, ``float`` (``nan`` and ``inf`` too), ``complex``, ``str``,
  ``bytes``; ``list``, ``tuple`` (a named tuple comes back as a plain tuple), ``dict`` (any keys
  of these types), ``set``, ``frozenset``;
* ``torch.Tensor`` (dtype, shape and raw bytes; a parameter comes back as a plain tensor),
  ``torch.dtype``, ``torch.Size``, ``torch.device``;
* :class:`minidist.trace.Trace`, and the dataclasses minidist defines (its trace events, the
  pipeline executor's step statistics, ...), rebuilt by their own constructor from plain fields.

Anything else is a :class:`TypeError` in the rank that names where it sits in the result
(``result[2]['model']: a Linear``), so the fix (return ``model.state_dict()``) is one line.
A malformed file is a :class:`ValueError` on reading, never anything executed.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import sys

import torch

from minidist.trace.events import Event, Trace

_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
MAX_DEPTH = 64


def dumps(obj) -> bytes:
    """``obj`` as plain data (UTF-8 JSON); TypeError for a type this module does not carry."""
    return json.dumps(_encode(obj, "result", 0), separators=(",", ":")).encode()


def loads(data: bytes):
    """The value :func:`dumps` wrote; ValueError for anything else (no code runs, whatever ``data`` is)."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"not plain data: {err}") from None
    return _decode(doc, 0)


def _float(x: float):
    return x if math.isfinite(x) else {"float": repr(x)}


def _encode(obj, where: str, depth: int):
    if depth > MAX_DEPTH:
        raise TypeError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _float(float(obj))
    if isinstance(obj, complex):
        return {"complex": [_float(obj.real), _float(obj.imag)]}
    if isinstance(obj, bytes):
        return {"bytes": base64.b64encode(obj).decode()}
    if isinstance(obj, torch.Tensor):
        return {"tensor": _tensor(obj, where)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, Trace):
        return {"trace": [_encode(e, f"{where}.events[{i}]", depth + 1) for i, e in enumerate(obj.events)]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and _minidist_record(type(obj)):
        t = type(obj)
        return {"record": [t.__module__, t.__qualname__, {f.name: _encode(getattr(obj, f.name), f"{where}.{f.name}",
                                                                         depth + 1) for f in dataclasses.fields(obj)}]}
    if isinstance(obj, dict):
        return {"dict": [[_encode(k, f"{where} key {k!r}", depth + 1), _encode(v, f"{where}[{k!r}]", depth + 1)]
                         for k, v in obj.items()]}
    for kind, name in ((list, "list"), (tuple, "tuple"), (frozenset, "frozenset"), (set, "set")):
        if isinstance(obj, kind):
            return {name: [_encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]}
    raise TypeError(f"{where}: a {type(obj).__name__}, which a rank cannot send back; return tensors, numbers, "
                    f"strings, lists, tuples or dicts of them (a module's state_dict(), not the module)")


def _tensor(t: torch.Tensor, where: str) -> dict:
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise TypeError(f"{where}: a {t.layout} {t.device.type} tensor cannot be sent back; return a dense one")
    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw.numpy().tobytes()).decode()}


def _decode(doc, depth: int):
    if depth > MAX_DEPTH:
        raise ValueError(f"not plain data: nested more than {MAX_DEPTH} levels deep")
    if doc is None or isinstance(doc, (bool, int, float, str)):
        return doc
    if isinstance(doc, list):
        return [_decode(v, depth + 1) for v in doc]
    if not (isinstance(doc, dict) and len(doc) == 1):
        raise ValueError(f"not plain data: {type(doc).__name__}")
    (tag, body), = doc.items()
    try:
        return _TAGS[tag](body, depth)
    except KeyError:
        raise ValueError(f"not plain data: unknown tag {tag!r}") from None
    except (TypeError, AttributeError, IndexError, RuntimeError, base64.binascii.Error) as err:
        raise ValueError(f"not plain data: a malformed {tag}: {err}") from None


def _decode_float(body, depth):
    if isinstance(body, (int, float)):
        return float(body)
    if body not in ("nan", "inf", "-inf"):
        raise ValueError(f"not plain data: float {body!r}")
    return float(body)


def _decode_tensor(body, depth):
    dtype, shape = _dtype(body["dtype"]), body["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"not plain data: a tensor of shape {shape!r}")
    raw = base64.b64decode(body["data"], validate=True)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"not plain data: {len(raw)} bytes for a {dtype} tensor of shape {shape}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw \
        else torch.empty(shape, dtype=dtype, device="cpu")


def _dtype(name):
    if not isinstance(name, str) or name not in _DTYPES:
        raise ValueError(f"not plain data: dtype {name!r}")
    return _DTYPES[name]


def found_where_it_says(cls) -> bool:
    """Whether ``cls`` is what its module's namespace holds under its qualified name (``__module__``
    and ``__qualname__`` are only claims: a class defined elsewhere may carry any)."""
    found = sys.modules.get(getattr(cls, "__module__", None) or "")
    for part in str(getattr(cls, "__qualname__", "")).split("."):
        found = getattr(found, part, None)
    return found is cls


def _minidist_record(cls) -> bool:
    """A dataclass of minidist's own, found where it says it is (a rank may claim any name)."""
    return (str(cls.__module__ or "").startswith("minidist.") and dataclasses.is_dataclass(cls)
            and found_where_it_says(cls))


def _decode_record(body, depth):
    module, qualname, fields = body
    cls = sys.modules.get(module) if isinstance(module, str) else None
    for part in str(qualname).split(".") if cls is not None else ():
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and _minidist_record(cls) and isinstance(fields, dict)
            and set(fields) == {f.name for f in dataclasses.fields(cls)}):
        raise ValueError(f"not plain data: a record of {module}.{qualname}")
    values = {k: _decode(v, depth + 1) for k, v in fields.items()}
    init = {f.name: values[f.name] for f in dataclasses.fields(cls) if f.init}
    try:
        obj = cls(**init)
    except Exception as err:          # noqa: BLE001  (its own constructor refused the fields)
        raise ValueError(f"not plain data: {module}.{qualname}({err})") from None
    for f in dataclasses.fields(cls):
        if not f.init:
            object.__setattr__(obj, f.name, values[f.name])
    return obj


def _decode_trace(body, depth):
    events = [_decode(v, depth + 1) for v in body]
    if not all(isinstance(e, Event) for e in events):
        raise ValueError("not plain data: a trace of something other than events")
    return Trace(events)


def _decode_dict(body, depth):
    out = {}
    for k, v in body:
        key = _decode(k, depth + 1)
        out[tuple(key) if isinstance(key, list) else key] = _decode(v, depth + 1)
    return out


_TAGS = {
    "float": _decode_float,
    "complex": lambda b, d: complex(_decode(b[0], d + 1), _decode(b[1], d + 1)),
    "bytes": lambda b, d: base64.b64decode(b, validate=True),
    "tensor": _decode_tensor,
    "dtype": lambda b, d: _dtype(b),
    "size": lambda b, d: torch.Size([int(n) for n in b]),
    "device": lambda b, d: torch.device(str(b)),
    "trace": _decode_trace,
    "record": _decode_record,
    "dict": _decode_dict,
    "list": lambda b, d: [_decode(v, d + 1) for v in b],
    "tuple": lambda b, d: tuple(_decode(v, d + 1) for v in b),
    "set": lambda b, d: set(_decode(v, d + 1) for v in b),
    "frozenset": lambda b, d: frozenset(_decode(v, d + 1) for v in b),
}
