"""Lab 8's checks refuse minidist's own memory techniques, in the checks that run in this process
(no launch: these cost well under a second each). The bugs the checks catch and the correct
alternatives they accept are in autograder/bugbank/lab8_memory.py, checked by the selftest."""
import pytest

from minidist import memory_techniques as library
from minidist.checks import lab8_memory as lab8


def recompute_via_library(blocks, x, policy="none"):
    return library.recompute_blocks(blocks, x, policy)


class ScalerSubclass(library.DynamicLossScaler):
    pass


@pytest.mark.parametrize("name, fn, what", [
    ("recompute_blocks", library.recompute_blocks, "the graded code is minidist's own"),
    ("recompute_blocks", recompute_via_library, "minidist.memory_techniques.recompute"),
    ("DynamicLossScaler", library.DynamicLossScaler, "minidist.memory_techniques.loss_scaler"),
    ("DynamicLossScaler", ScalerSubclass, "minidist.memory_techniques.loss_scaler"),
])
def test_lab8_refuses_the_library(name, fn, what):
    with pytest.raises(AssertionError, match="called minidist's own implementation") as err:
        lab8.check_function(name, fn)
    assert what in str(err.value) and "minidist.checks.lab8_memory" in str(err.value)


def test_lab8_names_its_graded_functions():
    with pytest.raises(ValueError, match="graded: DynamicLossScaler, mixed_precision_step"):
        lab8.check_function("zero2_step", lambda *a: None)
