"""What a sharded model (strategy ``fsdp``) cannot be trained with, refused before anything starts."""

from __future__ import annotations

from typing import Final

from lamploop.control.local import LocalControlFollower, LocalControlRoot
from lamploop.errors import ConfigurationError
from lamploop.settings import TrainingSettings
from lamploop.sync.fsdp import check_fsdp2_api

__all__ = ["SHARDED", "check_sharded_strategy"]

SHARDED: Final = "fsdp"
"""The registered name of the sharded strategy (:class:`lamploop.sync.fsdp.FullyShard`)."""


def check_sharded_strategy(
    where: str, settings: TrainingSettings, *, control: object = None, in_process: bool = False
) -> None:
    """ConfigurationError for a setting the sharded strategy cannot honour, naming it and why.

    - ``precision="fp16"``: the dynamic loss scale judges overflow from the gradients a rank
      holds; under ``fsdp`` each rank holds only its shard of them, so the ranks could skip
      different steps (``"bf16"`` needs no loss scale and is accepted);
    - ``averaging`` (EMA/SWA): the root averages its whole model, which no rank holds;
    - ranks as threads of one process (``control`` is an in-process channel, or ``in_process``:
      ``local_data_parallel_training_loop``, which checks before it makes its channel): FSDP2
      registers one process group per process and its ranks' device mesh by process, so the
      ranks must be processes (``fit(world_size=...)`` or the drivers under a launcher);
    - a torch whose FSDP2 lacks a method the strategy needs (:func:`~lamploop.sync.fsdp.check_fsdp2_api`).
    """
    if settings.strategy != SHARDED:
        return
    if settings.precision == "fp16":
        msg = (
            f"{where}: precision='fp16' cannot be combined with strategy 'fsdp': its dynamic loss "
            "scale judges overflow from the gradients a rank holds, and each rank holds only its "
            "shard of them (the ranks could skip different steps); use precision='bf16'"
        )
        raise ConfigurationError(msg)
    if settings.averaging is not None:
        msg = (
            f"{where}: averaging cannot be combined with strategy 'fsdp': the weight average is "
            "kept of the whole model on the root, and under fsdp no rank holds the whole model"
        )
        raise ConfigurationError(msg)
    if in_process or isinstance(control, LocalControlRoot | LocalControlFollower):
        channel = "an in-process control channel (local_control)"
        if in_process:
            channel = "local_data_parallel_training_loop"
        msg = (
            f"{where}: strategy 'fsdp' cannot run under {channel}: its ranks are threads of one "
            "process, and FSDP2 shards over one process per rank; use fit(strategy='fsdp', "
            "world_size=n) or the drivers with a TCP channel, one process per rank"
        )
        raise ConfigurationError(msg)
    check_fsdp2_api(where)
