"""The loop: ``epochs`` drives epochs, ``one_epoch`` runs one pass over a batch stream.

- :mod:`~lamploop.loop.epoch_driver` -- the epoch driver: schedule, validation frequency,
  smoothing, model selection, checkpoint callback; training itself is an awaited effect;
- :mod:`~lamploop.loop.epoch_pass` -- one pass, training or forward-only, the same code on
  every rank (everything that crosses ranks goes through a tensor channel);
- :mod:`~lamploop.loop.batch_checks` -- what a stream yields is checked, and errors say where;
- :mod:`~lamploop.loop.non_finite` -- a step with a NaN or infinite loss: raise or skip, alike
  on every rank.
"""

from lamploop.loop.epoch_driver import ALL_EPOCHS, AllEpochs, epochs
from lamploop.loop.epoch_pass import one_epoch

__all__ = ["ALL_EPOCHS", "AllEpochs", "epochs", "one_epoch"]
