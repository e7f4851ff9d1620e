"""Random states in a checkpoint: torch's CPU generator, every CUDA device's, Python's, numpy's.

A resumed run must draw the numbers the uninterrupted run would have drawn next (dropout masks,
noise, augmentation), so each rank saves the state of every generator it draws from as a small
tensor of its own, ``rng.rank<r>.<source>``, and a load puts it back bit for bit:

* ``cpu``: :func:`torch.random.get_rng_state` (the CPU generator's Mersenne Twister, 5056 bytes);
* ``cuda<i>``: :func:`torch.cuda.get_rng_state` of every visible device i (Philox's seed and offset);
* ``python``: :func:`random.getstate`, as 627 int64: the 625 words of the Mersenne Twister and its
  position, whether :func:`random.gauss` holds a cached value, and that value's float64 bits;
* ``numpy``: numpy's global (legacy) generator, :func:`numpy.random.get_state`, likewise: 624 words,
  the position, the cached-Gaussian flag and bits. Generators made by ``numpy.random.default_rng``
  are objects of their owner's, not global state, and are not included.

CUDA's are included by default (``cuda=None``) when this process has initialised CUDA: one that
never did has drawn nothing from a CUDA generator, and its restart reaches the same state by
running the same seeding code. ``cuda=True`` asks for them (an error without CUDA); ``False`` omits.

The states are rank-local: each rank writes and reads its own. A rank that exists again gets its
states back; a rank the checkpoint has none for (more ranks than were saved) keeps the states it
has, and so does a device or source the checkpoint lacks (its piece stays ``loaded`` False).
"""
from __future__ import annotations

import random
import struct

import torch

from minidist.checkpoint.layouts import State
from minidist.checkpoint.pieces import Piece

__all__ = ["rng_state", "rng_sources"]


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_f64(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def _python_get() -> torch.Tensor:
    version, words, gauss = random.getstate()
    if version != 3 or len(words) != 625:
        raise RuntimeError(f"random.getstate() has version {version} and {len(words)} words; this code knows 3 and 625")
    vals = list(words) + [int(gauss is not None), _f64_bits(gauss if gauss is not None else 0.0)]
    return torch.tensor(vals, dtype=torch.int64, device="cpu")


def _python_set(t: torch.Tensor) -> None:
    v = t.tolist()
    random.setstate((3, tuple(v[:625]), _bits_f64(v[626]) if v[625] else None))


def _numpy_get() -> torch.Tensor:
    import numpy as np
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    vals = [int(k) for k in keys] + [int(pos), int(has_gauss), _f64_bits(float(cached))]
    return torch.tensor(vals, dtype=torch.int64, device="cpu")


def _numpy_set(t: torch.Tensor) -> None:
    import numpy as np
    v = t.tolist()
    np.random.set_state(("MT19937", np.array(v[:624], dtype=np.uint32), v[624], v[625], _bits_f64(v[626])))


def _cuda_wanted(cuda) -> bool:
    if cuda is None:
        return torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda and not torch.cuda.is_available():
        raise ValueError("rng_state(cuda=True): this process sees no CUDA device (cuda=None includes CUDA's "
                         "states only where CUDA is initialised)")
    return bool(cuda)


def rng_sources(cuda: bool | None = None, python: bool = True, numpy: bool = True) -> dict:
    """source name -> (get, set): how each generator's state becomes a CPU tensor and back."""
    out = {"cpu": (torch.random.get_rng_state, torch.random.set_rng_state)}
    if _cuda_wanted(cuda):
        for i in range(torch.cuda.device_count()):
            out[f"cuda{i}"] = (lambda i=i: torch.cuda.get_rng_state(i), lambda t, i=i: torch.cuda.set_rng_state(t, i))
    if python:
        out["python"] = (_python_get, _python_set)
    if numpy:
        out["numpy"] = (_numpy_get, _numpy_set)
    return out


def rng_state(rank: int, *, cuda: bool | None = None, python: bool = True, numpy: bool = True) -> State:
    """This rank's random states, as they are now (saved) and as a load restores them (after it has
    filled them), keys ``rng.rank<rank>.<source>``."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    out = State()
    for source, (get, put) in rng_sources(cuda, python, numpy).items():
        key, now = f"rng.rank{rank}.{source}", get().to("cpu").contiguous()
        scratch = torch.empty_like(now)
        target = Piece(key, scratch, tuple(now.shape), (0,))

        def restore(target=target, put=put):
            if target.loaded:
                put(target.tensor)
        out += State([Piece(key, now, tuple(now.shape), (0,))], [target], [restore])
    return out
