"""The learning-rate range test (Leslie Smith's; Lightning's ``Tuner.lr_find``, Ignite's ``FastaiLRFinder``).

:func:`lr_find` trains a deep copy of the model for up to ``num_steps`` optimizer steps,
the learning rate growing exponentially from ``min_lr`` to ``max_lr`` (step ``i`` of ``n``
at ``min_lr * (max_lr / min_lr) ** (i / (n - 1))``, every parameter group alike), and
records each step's mean training loss and its exponentially smoothed value
(``smoothing * previous + (1 - smoothing) * loss``, bias-corrected, as fastai and Lightning
do; ``smoothing=0.9`` by default, a window of about 10 steps, where their 0.98 lags the
loss by tens of steps).  It stops early once the smoothed loss exceeds
``divergence_threshold`` (4) times the best one so far, or the loss is NaN or infinite.

The suggestion is fastai's original rule, Smith's "an order of magnitude below the
minimum": the learning rate at the lowest smoothed loss, divided by 10
(:func:`min_loss_suggestion`).  Lightning's rule, the steepest descent of the smoothed loss
(:func:`steepest_descent`), is there to compare; it is not the default because, measured on
the digits in 8 configurations (an MLP with SGD, SGD with momentum and Adam, batch sizes
16 to 64, each against a sweep of 3-epoch runs at learning rates half a decade apart), it
landed 3.4x to 100x above the sweep's best rate in 6 of them with Lightning's smoothing of
0.98 (the lagging smoothed loss falls fastest where the loss is at its lowest or already
diverging), where "minimum / 10" stayed within 3x in 7 of 8 (0.44x to 1.4x; the eighth
4.3x below, where the sweep's two best rates were nearly tied).  ``tests/test_lr_find.py``
checks two of those configurations.  The suggestion is a starting point for a constant
learning rate or the start of a decaying schedule; a one-cycle schedule's maximum is nearer
the minimum itself.

The steps run through :func:`lamploop.one_epoch` on the copy, with the same gradient
accumulation, precision and clipping as a run's: a step is an optimizer step, of
``accumulate_gradient_over_n_batches`` batches.  The model passed in (its parameters,
buffers, gradients and train/eval mode), any optimizer of it, and the global random number
generators (torch's CPU one, and the CUDA device's where the copy trains) are left as they
were, bit for bit: the copy and its optimizer are dropped at the end.  The copy needs memory
for a second model and its optimizer state.

The test is a package of modules of one job each: :mod:`~lamploop.lr_find.range_test` (the
test itself, :func:`lr_find` and :func:`lr_find_async`), :mod:`~lamploop.lr_find.recorder`
(the rates, the recorded losses and the divergence test), :mod:`~lamploop.lr_find.suggestions`
(the two rules) and :mod:`~lamploop.lr_find.result` (:class:`LrFindResult` and its plot).

.. versionadded:: 0.3
"""

from lamploop.lr_find.range_test import lr_find, lr_find_async
from lamploop.lr_find.result import LrFindResult
from lamploop.lr_find.suggestions import SKIP_BEGIN as SKIP_BEGIN  # importable from here, as before
from lamploop.lr_find.suggestions import SKIP_END as SKIP_END
from lamploop.lr_find.suggestions import min_loss_suggestion, steepest_descent

__all__ = ["LrFindResult", "lr_find", "lr_find_async", "min_loss_suggestion", "steepest_descent"]
