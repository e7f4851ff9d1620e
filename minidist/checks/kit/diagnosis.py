"""Why a tensor is wrong: the worst element, and the likely cause when the numbers show one.

A failure that says only "differs from the reference (max |error| 0.0878)" leaves a student to
guess. The classic mistakes of distributed training leave fingerprints in the numbers, and
:func:`diagnose` reads them, most specific first:

* **a constant factor** ``got = c · want``: ``c = -1`` is a flipped sign; ``c`` equal to one of the
  case's named sizes (``factors``: the group's size t, the world's size N, k, …) or its inverse
  names that size ("off by a factor of 2 = t, the group's size"), the signature of a sum divided
  by the wrong count or an average taken twice; 2 is always tried (a sum counted twice);
* **zeros** where values were expected: a gradient that never arrived (a detached tensor, no
  backward path), or a result never written;
* **the right values in another order**: every row of the answer is a row of the reference
  (a permutation applied the wrong way, a chunk sent to the wrong peer), or the transpose;
* **only some rows wrong**: which ones (one rank's share, one chunk);
* **a sum missing some of its terms** (:func:`sum_of_which_inputs`, the collectives of lab 1): which
  ranks' inputs each wrong chunk holds, and whether it is in its own place or another chunk's.

Each is tested on its classic mistake in ``tests/test_diagnosis.py``. Tolerances are those of the
comparison that found the mismatch (:func:`minidist.checks.kit.compare.tensor_error`), so a
diagnosis never names a cause the comparison itself would not accept as equal.
"""
from __future__ import annotations

import torch

ALWAYS = {"2": 2.0}     # a sum counted twice, or halved once too often


def diagnose(got: torch.Tensor, want: torch.Tensor, atol: float, factors: dict | None = None,
             what: str = "") -> str:
    """``"; worst at [i, j]: got x, expected y; likely cause: ..."`` for float64 CPU tensors of the
    same shape that differ by more than ``atol`` somewhere (``factors``: {name: size})."""
    text = f"; {worst_element(got, want)}"
    cause = likely_cause(got, want, atol, factors, what)
    return text + (f"; {cause}" if cause else "")


def worst_element(got: torch.Tensor, want: torch.Tensor) -> str:
    diff = (got - want).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = int(diff.reshape(-1).argmax())
    index = _unravel(flat, tuple(got.shape))
    at = f"[{', '.join(map(str, index))}]" if index else "(the scalar)"
    return f"worst at {at}: got {float(got.reshape(-1)[flat]):.6g}, expected {float(want.reshape(-1)[flat]):.6g}"


def _unravel(flat: int, shape: tuple) -> list[int]:
    """The index of element ``flat`` of a row-major tensor of ``shape`` (torch.unravel_index
    imports sympy on first use: most of a second in every rank of a failing launch)."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return index[::-1]


def likely_cause(got, want, atol: float, factors: dict | None = None, what: str = "") -> str:
    """The likely cause in a few words, or "" when the numbers show none."""
    for reading in (_factor, _zeros, _rows_reordered, _transposed, _values_reordered, _some_rows):
        cause = reading(got, want, atol, {**(factors or {}), **ALWAYS}, what)
        if cause:
            return cause
    return ""


def _close(a, b, atol) -> bool:
    return a.shape == b.shape and bool(((a - b).abs() <= atol).all())


def _factor(got, want, atol, factors, what):
    big = want.abs() > 10 * atol
    if not bool(big.any()):
        return ""
    ratio = (got[big] / want[big]).median().item()
    if abs(ratio - 1) < 1e-6 or abs(ratio) < 1e-6 or not _close(got, ratio * want, atol * max(1.0, abs(ratio))):
        return ""
    if abs(ratio + 1) < 1e-3:
        return "likely cause: the sign is flipped (got = -expected everywhere)"
    for size in sorted({float(v) for v in factors.values() if v not in (0, 1)}, reverse=True):
        for c, how in ((size, "times"), (1 / size, "divided by")):
            if abs(ratio - c) <= 1e-3 * abs(c):
                names = [name for name, v in factors.items() if float(v) == size and name != f"{size:g}"]
                label = " = ".join([f"{size:g}"] + names)
                return (f"likely cause: every value is the expected one {how} {label} (off by a factor of {label}; "
                        f"was a sum divided by the wrong count, or an average taken twice?)")
    return f"likely cause: every value is {ratio:.4g} times the expected one (a constant factor)"


def _zeros(got, want, atol, factors, what):
    if not bool((got.abs() <= atol).all()):
        return ""
    if "grad" in what:
        return ("likely cause: it is all zeros: no gradient flowed back to it (a detached tensor, or a "
                "path with no backward, such as a communication outside an autograd.Function)")
    return "likely cause: it is all zeros, where nonzero values were expected (a result never written or added?)"


def _rows(x):
    return x.reshape(x.shape[0], -1)


def _match_rows(got, want, atol):
    """For every row of ``got``, a row of ``want`` it equals, each used once (repeated rows, as when
    one token goes to two experts, pair up in turn), or None where none is left."""
    if got.dim() < 1 or got.shape[0] < 2 or got.shape[0] > 1024:
        return None
    equal = (torch.cdist(_rows(got), _rows(want), p=float("inf")) <= atol).tolist()
    used, matched = set(), []
    for i, row in enumerate(equal):
        if row[i] and i not in used:         # a row in its own place stays there
            j = i
        else:
            j = next((j for j, same in enumerate(row) if same and j not in used and not equal[j][j]), None)
            j = j if j is not None else next((j for j, same in enumerate(row) if same and j not in used), None)
        if j is not None:
            used.add(j)
        matched.append(j)
    return matched


def _rows_reordered(got, want, atol, factors, what):
    matched = _match_rows(got, want, atol)
    if matched is None or None in matched or sorted(matched) != list(range(len(matched))):
        return ""
    moved = [(i, j) for i, j in enumerate(matched) if i != j]
    shown = ", ".join(f"row {i} holds expected row {j}" for i, j in moved[:4]) + (", ..." if len(moved) > 4 else "")
    return (f"likely cause: the right rows in the wrong order ({shown}): was a permutation applied the "
            f"wrong way round (its inverse), or a chunk placed at the sender's index instead of the receiver's?")


def _transposed(got, want, atol, factors, what):
    if got.dim() == 2 and got.shape[0] == got.shape[1] and _close(got, want.T, atol):
        return "likely cause: it is the transpose of the expected matrix"
    return ""


def _values_reordered(got, want, atol, factors, what):
    if got.numel() < 2 or not _close(got.reshape(-1).sort().values, want.reshape(-1).sort().values, atol):
        return ""
    return "likely cause: the right values in another order (an index, a reshape or a view taken the wrong way)"


def _some_rows(got, want, atol, factors, what):
    if got.dim() < 1 or got.shape[0] < 2:
        return ""
    wrong = torch.nonzero(~((got - want).abs() <= atol).reshape(got.shape[0], -1).all(dim=1)).flatten().tolist()
    if len(wrong) == got.shape[0]:
        return ""
    unit = "row" if got.dim() > 1 else "element"
    listed = ", ".join(map(str, wrong[:8])) + (", ..." if len(wrong) > 8 else "")
    return (f"{len(wrong)} of {got.shape[0]} {unit}s are wrong ({unit}{'s' if len(wrong) > 1 else ''} {listed}), the "
            f"others are right: look at what is special about those (one rank's share, one chunk, the last one)")


WHY = {   # what each reading of a wrong chunk of a sum suggests, said once however many chunks show it
    "partial": "a partial sum: a received chunk written over the running sum instead of added to it, "
               "or a step or a phase left out?",
    "own": "this rank's own input, never reduced or never replaced by the total: was the phase that "
           "brings the result back left out?",
    "moved": "the right sum in the wrong place: a chunk index off by one step, or the sender's index "
             "used for the receiver's?",
    "mixed": "a partial sum in the wrong place: an index off by one step, and a step missing?",
}


def sum_of_which_inputs(got: torch.Tensor, inputs: list, rank: int, chunk: int | None, close) -> str:
    """For a reduction (a sum of one input per rank), which inputs each wrong chunk of rank ``rank``'s
    result ``got`` holds: ``"likely cause: chunk 1 holds the sum over rank 0 only (missing the input of
    rank 1): a partial sum: ..."``, or "" when no sum of inputs matches.

    ``got`` is the whole sum, read as ``tensor_split(len(inputs))`` (all-reduce, ``chunk=None``), or
    its chunk ``chunk`` alone (reduce-scatter). ``close(a, b)`` is the comparison that found the
    mismatch. The classic mistakes of a ring or a tree leave a chunk that is a partial sum or the
    right sum in another chunk's place; with random inputs nothing else matches by chance."""
    n = len(inputs)
    pieces = [t.tensor_split(n) for t in inputs]
    mine = list(enumerate(got.tensor_split(n))) if chunk is None else [(chunk, got)]
    found = []
    for c, piece in mine:
        if piece.numel() and not close(piece, sum(p[c] for p in pieces)):
            found.append(_partial_sum(piece, pieces, c, rank, close))
    found = [f for f in found if f]
    if not found:
        return ""
    shown = "; ".join(text for _, text in found[:3]) + ("; ..." if len(found) > 3 else "")
    kinds = list(dict.fromkeys(kind for kind, _ in found))
    return f"likely cause: {shown}: " + " ".join(WHY[k] for k in kinds)


def _ranks(ranks) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _partial_sum(piece, pieces, c, rank, close) -> tuple[str, str] | None:
    """(kind, "chunk c holds ...") for the sum of inputs this chunk equals, its own chunk's first."""
    n = len(pieces)
    subsets = sorted(range(1, 2 ** n), key=lambda s: -bin(s).count("1"))
    for j in [c] + [j for j in range(n) if j != c]:
        if pieces[0][j].shape != piece.shape:
            continue
        for s in subsets:
            ranks = [r for r in range(n) if s >> r & 1]
            if not close(piece, sum(pieces[r][j] for r in ranks)):
                continue
            missing = [r for r in range(n) if r not in ranks]
            if j != c:
                return (("moved", f"chunk {c} holds the reduced chunk {j}") if not missing else
                        ("mixed", f"chunk {c} holds chunk {j} summed over {_ranks(ranks)} only"))
            if ranks == [rank]:
                return "own", f"chunk {c} holds this rank's own input only"
            return "partial", f"chunk {c} holds the sum over {_ranks(ranks)} only (missing the input of {_ranks(missing)})"
    return None
