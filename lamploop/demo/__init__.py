"""``lamploop demo``: a small MLP on scikit-learn's digits, on two local ranks, resumable.

- :mod:`lamploop.demo.run` -- the data, the model and the training run;
- :mod:`lamploop.demo.config` -- :class:`DemoConfig`, saved as ``config.json`` beside the
  checkpoints, and the strict reading and merging of such run configurations.
"""

from lamploop.demo.config import CONFIG_NAME, DemoConfig, load_config, resolve_config, save_config
from lamploop.demo.run import accuracy, demo_config, digits_data, digits_model, run_demo, train_demo

__all__ = [
    "CONFIG_NAME",
    "DemoConfig",
    "accuracy",
    "demo_config",
    "digits_data",
    "digits_model",
    "load_config",
    "resolve_config",
    "run_demo",
    "save_config",
    "train_demo",
]
