"""Lab 1's verdicts: every rank's result against torch on the same inputs, the traced messages
against the algorithm's pattern, and the refusal of a world size that is not a power of two."""
from __future__ import annotations

from functools import partial

from minidist.checks.kit import collectives
from minidist.checks.lab1_collectives.cases import GRADED

FUNCTION = {name: partial(collectives.verdict, name=name, kind=kind) for name, (kind, _, _) in GRADED.items()}
PATTERN = {name: partial(collectives.verdict, name=name, kind=kind, pattern=pattern)
           for name, (kind, pattern, _) in GRADED.items() if pattern is not None}


def rejected(name: str, world_size: int, outcomes: list) -> str | None:
    """Every rank raised ValueError (a rank that went ahead would wait for a partner that raised)."""
    silent = [r for r, (what, _) in enumerate(outcomes) if what != "ValueError"]
    if silent:
        return (f"{name} (world_size={world_size}): ranks {silent} returned instead of raising ValueError; "
                f"the lab asks for a ValueError that says N must be a power of two")
    return None
