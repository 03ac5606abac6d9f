"""Checkpoints: save and load a :class:`~lamploop.state.LoopStateWithModelAndOptimizerData`.

One directory per checkpoint, named after the epoch the run resumes at::

    <root>/
      latest                      one line: the name of the newest checkpoint directory
      epoch-000006/
        checkpoint.json           the descriptor: format version, loop state, schedule state,
                                  optimizer state without its tensors, RNG scalars, model
                                  specs, and the sha256 and size of every file below
        model.safetensors         the live model's state_dict
        best_model.safetensors    the best model's state_dict (no tensors when there is none yet)
        optimizer.safetensors     the tensors of optimizer.state_dict()
        rng.safetensors           the torch (CPU and CUDA), numpy and Python RNG states
        extra-<name>.safetensors  the tensors of each checkpoint extra, if any (their JSON
                                  meta is in checkpoint.json; see extras.py)

Nothing is pickled and nothing is read with ``torch.load``: tensors live in
safetensors files, everything else in JSON.  A checkpoint is written into a
hidden temporary sibling directory, every file and the directory are fsynced,
and only then is it renamed into place; ``latest`` is replaced atomically after
that, and old checkpoints beyond ``keep_last`` are pruned last.  A crash at any
moment leaves either the old or the new checkpoint, never a half-written one
under a checkpoint name.

:func:`load_checkpoint` checks everything before it hands anything back: the
format version, the descriptor's shape, every file's size and sha256, that the
safetensors files parse and hold exactly the tensors the descriptor lists, and
(when given a model) that the checkpoint's tensors fit the model.  Every
refusal is a :class:`~lamploop.errors.CheckpointError` whose message starts
with the file at fault.

Resuming::

    checkpoint = load_checkpoint(root, schedule=schedule, model=model, restore_rng=True)
    model.load_state_dict(checkpoint.state.model)
    restore_optimizer_state(optimizer, checkpoint)
    await epochs(..., init_state=checkpoint.state.loop_state,
                 learning_rate_schedule=schedule,
                 learning_rate_schedule_init_state=checkpoint.schedule_state,
                 checkpoint_state=...)

Only one process may save into a root directory at a time (in a distributed
run, the root rank).

The package's modules: :mod:`~lamploop.checkpoint.format` (names and the descriptor),
:mod:`~lamploop.checkpoint.rng`, :mod:`~lamploop.checkpoint.codec` (nested state as JSON
plus tensors), :mod:`~lamploop.checkpoint.files` (atomic writes, save order, pruning),
:mod:`~lamploop.checkpoint.extras` (named state beside the model),
:mod:`~lamploop.checkpoint.save`, :mod:`~lamploop.checkpoint.load` (which directory a path
names: :mod:`~lamploop.checkpoint.locate`; each file's checked read:
:mod:`~lamploop.checkpoint.checked_reads`), :mod:`~lamploop.checkpoint.sharded` (a sharded
model's per-rank shards: ``sharded_index``, ``sharded_save``, ``sharded_load``, ``sharded_verify``),
:mod:`~lamploop.checkpoint.integrity` (one file against its record),
:mod:`~lamploop.checkpoint.verify` (every problem found at once: :func:`verify_checkpoint`,
which ``lamploop inspect`` prints) and :mod:`~lamploop.checkpoint.checkpointer`.
"""

from lamploop.checkpoint.checkpointer import Checkpointer
from lamploop.checkpoint.extras import CheckpointExtra, extra_file
from lamploop.checkpoint.format import (
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    checkpoint_name,
    rank_rng_file,
)
from lamploop.checkpoint.load import Checkpoint, latest_checkpoint, load_checkpoint
from lamploop.checkpoint.restore import restore_optimizer_state
from lamploop.checkpoint.rng import RngStates
from lamploop.checkpoint.save import save_checkpoint
from lamploop.checkpoint.verify import CheckpointReport, verify_checkpoint

__all__ = [
    "BEST_MODEL_FILE",
    "DESCRIPTOR_NAME",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "Checkpoint",
    "CheckpointReport",
    "CheckpointExtra",
    "Checkpointer",
    "RngStates",
    "checkpoint_name",
    "extra_file",
    "latest_checkpoint",
    "load_checkpoint",
    "rank_rng_file",
    "restore_optimizer_state",
    "save_checkpoint",
    "verify_checkpoint",
]
