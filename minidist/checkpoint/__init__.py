"""Distributed checkpoints: sharded, reshardable, atomic, verified, asynchronous.

    from minidist import checkpoint as ckpt
    state = ckpt.flat_sharded(fsdp_model) + ckpt.rng_state(rank)   # this rank's boxes, its random states
    ckpt.save("ckpts", state, step=100, extra={"sampler": sampler.state_dict(), "scaler": scaler.state_dict()})
    path = ckpt.latest("ckpts")                                    # newest checkpoint that verifies
    extra = ckpt.load(path, ckpt.replicated(model, opt))           # under another layout, N' ranks

Files, in reading order: ``pieces`` (a shard is a box; flat ZeRO shards are unions of boxes),
``layouts`` (which boxes each layout holds), ``rng`` (the random states a rank draws from),
``save`` (sharded, atomic, async; a CRC-32 per chunk of every piece), ``reads`` (only the chunks
a box needs, each verified), ``load`` (verify, intersect, copy), ``sampler`` (a data order that
resumes), ``portable`` (the simple format lab 10 teaches: :func:`export_portable` to it,
:func:`load_portable` from it). Surviving a failure: ``minidist.launch(..., max_restarts=R)``
(or ``torchrun --max-restarts R``) starts the ranks again and each resumes from :func:`latest`
(:mod:`minidist.harness.checkpoint` does it). How often to save (Young 1974, Daly 2006) and what
it costs: :mod:`minidist.cost.checkpoint`.
"""
from minidist.checkpoint.layouts import State, dtensors, ensure_optimizer_state, flat_sharded, replicated, trainer3d
from minidist.checkpoint.load import CheckpointError, latest, load, read_metadata, verify
from minidist.checkpoint.pieces import Piece, flat_pieces, flat_range_boxes, intersect
from minidist.checkpoint.portable import export_portable, load_portable, save_portable, verify_portable
from minidist.checkpoint.rng import rng_state
from minidist.checkpoint.save import FORMAT, Pending, checkpoint_dir, save

__all__ = ["State", "dtensors", "ensure_optimizer_state", "flat_sharded", "replicated", "rng_state", "trainer3d",
           "CheckpointError", "latest", "load", "read_metadata", "verify", "Piece", "flat_pieces", "flat_range_boxes",
           "intersect", "export_portable", "load_portable", "save_portable", "verify_portable", "FORMAT", "Pending",
           "checkpoint_dir", "save"]
