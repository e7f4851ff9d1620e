"""Lab 10's checks (distributed checkpointing: sharded, reshardable, atomic, verified): each graded
function against the lab's format (the library's portable one, :mod:`minidist.checkpoint.portable`),
in this process, in a temporary directory of its own. A lab test cell is a one-liner::

    checks.check_save_sharded(save_sharded)
    checks.check_save_sharded(save_sharded, hidden=True)
    checks.check_device(load_resharded)     # the loaded pieces in host memory, whatever the default device

``save_sharded`` is checked on what it leaves on disk: the shards each rank writes (the layout's
boxes, bit-exact: the bytes per rank are the formula's), the metadata (shapes, dtypes, offsets,
sizes, checksums), and a disk that fills up in the middle of the save (no torn directory, the
error reaches the caller, the previous checkpoint untouched). ``load_resharded`` loads a
checkpoint the library saved under one layout into another (fewer ranks, rows to columns,
replicated to sharded), bit-exact, and must refuse a checkpoint without its metadata.
``latest_checkpoint`` must choose the newest good checkpoint among good, torn, truncated,
corrupted and garbled ones; ``check_device`` runs ``load_resharded``'s first visible case with torch's default device
``meta`` (kit/device_check.py): every piece it returns must be on the CPU. ``checkpoint_interval`` and ``goodput`` (how often to save, and the
share of time left for training) are checked against :mod:`minidist.cost.checkpoint`
(``checkpoint_interval.py``, ``goodput.py``). ``minidist.checkpoint`` (the library's own) and
that cost model are refused while graded code runs, and so is :mod:`.checkpoints` (the
checkpoints the checks start from, written by the library before the student's code runs). The cases are in ``cases.py``, the code that runs the
student's functions in ``answers.py``, the comparisons in ``verdicts.py`` (docs/AUTHORING.md); the
helpers the notebook hands out in ``helpers.py``.
"""
from __future__ import annotations

from functools import partial

from minidist.checks.kit.check import BY_NAME, Registry
from minidist.checks.kit.refusal import Refusal
from minidist.checks.lab10_checkpointing import answers, cases, checkpoints, verdicts
from minidist.checks.lab10_checkpointing.checkpoints import damage
from minidist.checks.lab10_checkpointing.helpers import box, sha256_of, split_range
from minidist.checks.lab10_checkpointing.restart_kit import Sampler, Store, new_run, training_step
from minidist.runtime import import_optimizers_before_fork

#: minidist's checkpointing (and torch's) is refused in graded code, and so are the checkpoints the
#: checks write with it (:mod:`.checkpoints`) and the cost model the interval and goodput are checked
#: against (:mod:`minidist.cost.checkpoint`); the lab hands out no helper from them.
REFUSED = Refusal("distributed checkpointing",
                  ("minidist.checkpoint", "torch.distributed.checkpoint", "minidist.cost.checkpoint",
                   checkpoints.__name__), checks=__name__)
CHECKS = Registry(__name__, refusal=REFUSED)

_TABLE = {"save_sharded": (cases.save_cases, answers.saved, verdicts.saved, cases.save_covered,
                           checkpoints.before_save),
          "load_resharded": (cases.load_cases, answers.loaded, verdicts.loaded, cases.load_covered,
                             checkpoints.before_load),
          "latest_checkpoint": (cases.latest_cases, answers.chosen, verdicts.chosen,
                                cases.latest_covered, checkpoints.before_latest)}
#: graded name -> its check, in the notebook's order; each case's root is built (``reference``) before the
#: student's code runs, outside the refusal
FUNCTIONS = {name: CHECKS.check(name, c, a, v, covered=cov, launch={"reference": root})
             for name, (c, a, v, cov, root) in _TABLE.items()}
#: the function that makes tensors of its own (the pieces it reads into host memory)
DEVICE = CHECKS.devices(FUNCTIONS["load_resharded"], rule="every piece it returns is in host memory", advice=(
    "On a GPU node whose default device is its GPU, that tensor would be there, not in host memory where a loaded "
    "piece belongs: make it with device=\"cpu\", and read safetensors' slices under with torch.device(\"cpu\")."))

#: box, split_range, sha256_of: the lab's helpers (:mod:`.helpers`); Sampler, Store, new_run, training_step: the
#: restart exercise's (:mod:`.restart_kit`); damage: what the checks and demo cells break
__all__ = ["CHECKS", "REFUSED", "Sampler", "Store", "box", "check_checkpoint_interval", "check_device", "check_goodput",
           "check_latest_checkpoint", "check_load_resharded", "check_save_sharded", "check_train_resumable", "damage",
           "new_run", "sha256_of", "split_range", "check_async_saver", "training_step"]


@CHECKS.entry(FUNCTIONS["save_sharded"])
def check_save_sharded(fn, *, hidden: bool = False) -> None:
    """``save_sharded``: each rank's shards (the layout's boxes, bit-exact), the metadata (shapes, dtypes,
    offsets, sizes, checksums), and a crash mid-save (no torn directory, the error reaches the caller, the
    previous checkpoint untouched). Hidden: uneven splits, a rank with nothing, fp64, three ranks."""


@CHECKS.entry(FUNCTIONS["load_resharded"])
def check_load_resharded(fn, *, hidden: bool = False) -> None:
    """``load_resharded``: a checkpoint the library saved under one layout, loaded into another (fewer ranks,
    rows to columns, replicated to sharded), bit-exact, every piece on the CPU; a checkpoint without its
    metadata refused."""


@CHECKS.entry(DEVICE, by=BY_NAME)
def check_device(fn) -> None:
    """Where the pieces of ``load_resharded`` (found by its name) live: its first visible case, run with
    torch's default device ``meta`` (kit/device_check.py). A piece not on the CPU fails, naming the line
    that made a tensor without ``device=``: host memory is where a loaded piece belongs."""


@CHECKS.entry(FUNCTIONS["latest_checkpoint"])
def check_latest_checkpoint(fn, *, hidden: bool = False) -> None:
    """``latest_checkpoint``: the newest good checkpoint among good, torn, truncated, corrupted and garbled
    ones (hidden: step_99 against step_100)."""


CHECKPOINT_INTERVAL = CHECKS.exercise("checkpoint_interval")


@CHECKS.entry(CHECKPOINT_INTERVAL)
def check_checkpoint_interval(fn, *, hidden: bool = False) -> None:
    """``checkpoint_interval(save_s, gpu_mtbf_s, gpus)``: the job's MTBF from the per-GPU one, Young's and
    Daly's intervals, against :mod:`minidist.cost.checkpoint` (hidden: one GPU, C >= 2M, a tiny save)."""


GOODPUT = CHECKS.exercise("goodput")


@CHECKS.entry(GOODPUT)
def check_goodput(fn, *, hidden: bool = False) -> None:
    """``goodput(interval_s, save_s, mtbf_s, restart_s=0.0, blocking_s=None)``: the share of wall time kept,
    against :func:`minidist.cost.checkpoint.goodput` (hidden: nothing kept, a restart, no stall)."""


ASYNC_SAVER = CHECKS.exercise("async_saver", answer=answers.async_saved, function="AsyncSaver")


@CHECKS.entry(ASYNC_SAVER)
def check_async_saver(fn, *, hidden: bool = False) -> None:
    """``AsyncSaver(write)``: save() copies the state to host memory and returns while a thread writes it (the
    state changed right after the call), one write at a time, a background failure raised once by the next
    wait() (hidden: by the next save, which then writes nothing; a bf16 state)."""


#: the answer runs here and launches the ranks itself (restarts, kills): its refusal holds on the ranks, where the
#: student's code runs, not around the launcher in this process; Adam's imports are made once, before the forks
TRAIN_RESUMABLE = CHECKS.exercise("train_resumable", answer=partial(answers.restarted, refusal=REFUSED), refusal=None,
                                  function="train_resumable", prepare=import_optimizers_before_fork)


@CHECKS.entry(TRAIN_RESUMABLE)
def check_train_resumable(fn, *, hidden: bool = False) -> None:
    """``train_resumable(model, optimizer, scaler, sampler, store, steps, every, group=None)`` on 2 ranks, killed
    mid-step and mid-save and relaunched (``launch(max_restarts=...)``): it must resume from ``store.latest()``
    and end bit-identical to a plain loop of ``training_step`` (weights, Adam, the loss scaler, the data position,
    torch's, Python's and numpy's random states). Visible: uninterrupted without a scaler; hidden: killed
    without one, a kill in the first save, a resume at the end of an epoch."""
