"""Sizes written by people: bytes (``80GB``, ``80GiB``, ``512MiB``, ``64K``) and parameter
counts (``70B``, ``1.3B``, ``7e9``), read the same way by every command and benchmark.

Bytes: ``KB``/``MB``/``GB``/``TB`` are powers of 1000 and ``KiB``/``MiB``/``GiB``/``TiB``
powers of 1024, as on data sheets; the bare letters ``K``/``M``/``G`` are powers of 1024,
as nccl-tests writes message sizes. Counts: ``K``, ``M``, ``B`` (billion), ``T``.
The ``*_arg`` functions are argparse ``type=`` callables: a bad value is an argparse
error naming what would have been read, never a traceback.
"""
from __future__ import annotations

import argparse
import re

BYTE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
              "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40,
              "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
COUNT_UNITS = {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}

_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


class UnitError(ValueError):
    """A size that cannot be read; the message says what would be."""


def _split(text: str, units: dict, what: str, example: str) -> tuple[float, str]:
    m = _NUMBER.fullmatch(str(text))
    if not m or m.group(2).upper() not in units:
        raise UnitError(f"cannot read {what} {text!r}; write e.g. {example}")
    return float(m.group(1)), m.group(2).upper()


def parse_bytes(text: str, *, bare: bool = True) -> int:
    """``"80GB"`` -> 80_000_000_000, ``"512MiB"`` -> 536_870_912, ``"64K"`` -> 65_536.
    With ``bare=False`` a number without a unit is refused: ``80`` is not 80 bytes of GPU memory."""
    value, unit = _split(text, BYTE_UNITS, "size", "80GB, 80GiB, 512MiB")
    if not unit and not bare:
        raise UnitError(f"{text!r} has no unit; write e.g. {text.strip()}GB (10^9 bytes) or {text.strip()}GiB (2^30)")
    return int(value * BYTE_UNITS[unit])


def parse_count(text: str) -> float:
    """``"70B"`` -> 7e10, ``"1.3B"`` -> 1.3e9, ``"7e9"`` -> 7e9 (B is billion here, not bytes)."""
    value, unit = _split(text, COUNT_UNITS, "count", "70B, 1.3B, 7e9")
    if value <= 0:
        raise UnitError(f"{text!r} is not a positive count")
    return value * COUNT_UNITS[unit]


def parse_byte_list(text: str) -> list[int]:
    """``"1K,64K,1M"`` -> [1024, 65536, 1048576]."""
    sizes = [parse_bytes(part) for part in str(text).split(",") if part.strip()]
    if not sizes:
        raise UnitError(f"no size in {text!r}; write e.g. 1K,64K,1M")
    return sizes


def parse_fraction(text: str) -> float:
    """``"10%"`` or ``"0.1"`` -> 0.1: a share between 0 and 1."""
    t = str(text).strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise UnitError(f"cannot read {text!r}; write e.g. 10% or 0.1") from None
    if not 0 <= value <= 1:
        raise UnitError(f"{text!r} is not between 0 and 1 (0% and 100%)")
    return value


def parse_positive_int(text: str) -> int:
    """``"8"`` -> 8; zero, negatives and fractions are refused."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UnitError(f"cannot read {text!r}; write a whole number such as 8") from None
    if value < 1:
        raise UnitError(f"{text!r} must be at least 1")
    return value


def parse_positive_float(text: str) -> float:
    """A number above 0: ``3.1``, ``50``."""
    try:
        value = float(text)
    except ValueError:
        raise UnitError(f"cannot read {text!r}; write a number such as 3.5") from None
    if not value > 0 or value == float("inf"):
        raise UnitError(f"{text!r} must be a number above 0")
    return value


def _arg(parse):
    def read(text):
        try:
            return parse(text)
        except UnitError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    read.__name__ = parse.__name__
    return read


memory_arg = _arg(lambda text: parse_bytes(text, bare=False))     # GPU memory: a unit is required
bytes_arg = _arg(parse_bytes)                                    # a message size: bare means bytes
byte_list_arg = _arg(parse_byte_list)
count_arg = _arg(parse_count)
fraction_arg = _arg(parse_fraction)
positive_int_arg = _arg(parse_positive_int)
positive_float_arg = _arg(parse_positive_float)
