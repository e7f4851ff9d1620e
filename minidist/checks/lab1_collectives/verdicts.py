"""Lab 1's verdicts beside the kit's collectives (:func:`minidist.checks.kit.collectives.verdict`: every
rank's result against torch on the same inputs, the traced messages against the algorithm's pattern):
the refusal of a world size that is not a power of two."""
from __future__ import annotations


def rejected(case, outcomes) -> str | None:
    """Every rank raised ValueError (a rank that went ahead would wait for a partner that raised)."""
    name, world_size = case
    silent = [r for r, (what, _) in enumerate(outcomes) if what != "ValueError"]
    if silent:
        return (f"{name} (world_size={world_size}): ranks {silent} returned instead of raising ValueError; "
                f"the lab asks for a ValueError that says N must be a power of two")
    return None
