"""Training on several ranks: the root drives, the followers follow.

- :mod:`~lamploop.distributed.drive` -- :func:`drive_distributed_training`, on the root;
- :mod:`~lamploop.distributed.follow` -- :func:`follow_distributed_training`, on the others;
- :mod:`~lamploop.distributed.local_parallel` -- :func:`local_data_parallel_training_loop`,
  one process with a replica per device;
- :mod:`~lamploop.distributed.replica` -- the epoch functions every rank shares;
- :mod:`~lamploop.distributed.worker` -- epochs on a worker thread, the event loop kept for
  the control channel;
- :mod:`~lamploop.distributed.process_group`, :mod:`~lamploop.distributed.initial_sync` --
  the process group, and what the ranks settle before the first epoch;
- :mod:`~lamploop.distributed.launch` -- rank and world size from torchrun, Slurm or
  lamploop's own spawner.
"""

from lamploop.distributed.drive import OptimizerFactory, drive_distributed_training
from lamploop.distributed.follow import follow_distributed_training
from lamploop.distributed.local_parallel import local_data_parallel_training_loop
from lamploop.loop.stop_request import StopRequest

__all__ = [
    "OptimizerFactory",
    "StopRequest",
    "drive_distributed_training",
    "follow_distributed_training",
    "local_data_parallel_training_loop",
]
