"""Federated rounds: FedAvg over nodes that keep their data.

- :mod:`~lamploop.federated.plan` -- the training plan as data, and its canonical hash;
- :mod:`~lamploop.federated.approval` -- each node's allow-list of approved plan hashes;
- :mod:`~lamploop.federated.models` -- the model, optimizer and loss a plan names, built on the node;
- :mod:`~lamploop.federated.wire` and :mod:`~lamploop.federated.link` -- the authenticated star
  over TCP (nodes connect out to the aggregator), tensors as safetensors;
- :mod:`~lamploop.federated.node` -- a node: reach the aggregator, answer or refuse its rounds;
- :mod:`~lamploop.federated.node_trainer` -- a node's round: validate, train locally, validate;
- :mod:`~lamploop.federated.aggregator` -- the aggregator: checks, resume, then its listener and
  round loop together;
- :mod:`~lamploop.federated.node_listener` -- the aggregator's listener: nodes admitted, their
  messages as events;
- :mod:`~lamploop.federated.round_loop` -- the rounds, FedAvg, records, checkpoints;
- :mod:`~lamploop.federated.settings` -- the settings of both ends;
- :mod:`~lamploop.federated.records` and :mod:`~lamploop.federated.checkpoints` -- what a run
  records and keeps;
- :mod:`~lamploop.federated.fedavg` -- the weighted average itself.

See docs/federated.md.

.. versionadded:: 0.3
"""

from lamploop.federated.aggregator import run_aggregator
from lamploop.federated.approval import AllowList, Approval, approve_plan, load_allow_list, save_allow_list
from lamploop.federated.fedavg import federated_average
from lamploop.federated.models import BUILT_IN_BUILDERS, ModelBuilders, build_model, mlp
from lamploop.federated.node import NodeSummary, run_node
from lamploop.federated.plan import (
    ModelDescription,
    OptimizerConfig,
    TrainingPlan,
    describe_model,
    load_plan,
    plan_from_json,
    plan_hash,
    plan_to_json,
    save_plan,
)
from lamploop.federated.records import FederatedResult, MissingNode, NodeReport, RoundRecord
from lamploop.federated.settings import AggregatorSettings, NodeSettings
from lamploop.federated.wire import Evaluation

__all__ = [
    "BUILT_IN_BUILDERS",
    "AggregatorSettings",
    "AllowList",
    "Approval",
    "Evaluation",
    "FederatedResult",
    "MissingNode",
    "ModelBuilders",
    "ModelDescription",
    "NodeReport",
    "NodeSettings",
    "NodeSummary",
    "OptimizerConfig",
    "RoundRecord",
    "TrainingPlan",
    "approve_plan",
    "build_model",
    "describe_model",
    "federated_average",
    "load_allow_list",
    "load_plan",
    "mlp",
    "plan_from_json",
    "plan_hash",
    "plan_to_json",
    "run_aggregator",
    "run_node",
    "save_allow_list",
    "save_plan",
]
