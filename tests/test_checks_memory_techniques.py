"""Lab 8's checks refuse minidist's own memory techniques, in the checks that run in this process
(no launch: these cost well under a second each). The bugs the checks catch and the correct
alternatives they accept are in solutions/lab8_memory/bugbank.py, checked by the selftest."""
import pytest

from minidist import memory_techniques as library
from minidist.checks import lab8_memory as lab8
from minidist.checks.kit.check import snake


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
        getattr(lab8, f"check_{snake(name)}")(fn)
    assert what in str(err.value) and "minidist.checks.lab8_memory" in str(err.value)


def test_lab8_names_the_functions_it_checks_where_tensors_live():
    def recompute_blocks(*args):
        return None
    with pytest.raises(ValueError, match="no check of 'recompute_blocks'; it checks DynamicLossScaler, "
                                         "zero1_mixed_precision_step"):
        lab8.check_device(recompute_blocks)


class OwnNumber(float):
    """A number of the student's own: its code would run wherever the answer is read."""


class ScalerWithItsOwnNumber:
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, group=None):
        self.scale_now = init_scale

    @property
    def loss_scale(self):
        return OwnNumber(self.scale_now)


def test_lab8_answers_carry_no_object_of_the_students():
    with pytest.raises(AssertionError, match="DynamicLossScaler.loss_scale returned a OwnNumber: return plain values"):
        lab8.check_dynamic_loss_scaler(ScalerWithItsOwnNumber)


def test_lab8_checks_run_where_the_registry_says():
    """The scaler in two parts (its bookkeeping here, unscale_ on groups of ranks), recompute_blocks here."""
    where = {name: [c.where for c in (checks if isinstance(checks, tuple) else (checks,))]
             for name, (_, checks, by) in lab8.CHECKS.entries.items() if name != "check_device"}
    assert where == {"check_dynamic_loss_scaler": ["here", "groups"], "check_mixed_precision_step": ["groups"],
                     "check_zero1_mixed_precision_step": ["groups"], "check_recompute_blocks": ["here"]}
