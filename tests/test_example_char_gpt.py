"""The char-level GPT example (examples/char_gpt) at its quick size: it learns, on 1 and 2 ranks,
and a run stopped after an epoch and resumed from its checkpoint ends bitwise equal to the
uninterrupted run (docs/how-to/resume.md promises it on the CPU; dropout is on, so the RNG
states in the checkpoint matter too); its command line prints the losses and a sample.

Rank 0 runs in this process (torch is imported once); the 2-rank run starts rank 1 as the
example's own script with the same arguments, as ``python train.py --ranks 2`` does.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import lamploop

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "char_gpt"
# The example's train.py under a name of its own (another example has a train.py too); it puts
# its folder on sys.path for its gpt and corpus modules.
_spec = importlib.util.spec_from_file_location("char_gpt_train", EXAMPLE / "train.py")
assert _spec is not None
assert _spec.loader is not None
example = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = example
_spec.loader.exec_module(example)
QUICK = example.QUICK


@pytest.fixture(scope="module")
def corpus() -> Any:
    return example.load_corpus(QUICK.max_chars)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # A model this small is fastest on one intra-op thread, and then immune to a busy second core.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def curve(state: lamploop.LoopState | None) -> list[float]:
    assert state is not None
    return [entry.training_loss for entry in state.learning_curve]


def test_quick_run_learns_and_a_resumed_run_ends_bitwise_equal(corpus: Any, tmp_path: Path) -> None:
    full_model, full = example.train(QUICK, corpus, out=tmp_path / "full", precision="bf16", reporters=[])
    losses = curve(full)
    assert len(losses) == QUICK.epochs
    assert losses[-1] < losses[0] - 0.3, losses  # from chance (ln 94 = 4.54) towards the text's statistics
    assert full is not None
    assert full.learning_curve[-1].validation_loss is not None
    assert full.learning_curve[-1].validation_loss[1] < math.log(corpus.vocab_size) - 1.0

    # Stopped after epoch 1 (a fresh model, a fresh fit call), then resumed to the end.
    stopped_dir = tmp_path / "stopped"
    _, first = example.train(QUICK, corpus, out=stopped_dir, max_epochs=1, precision="bf16", reporters=[])
    assert lamploop.latest_checkpoint(stopped_dir) is not None
    assert curve(first) == losses[:1]
    resumed_model, resumed = example.train(QUICK, corpus, out=stopped_dir, precision="bf16", reporters=[])
    assert resumed is not None
    assert resumed.learning_curve == full.learning_curve
    for (name, a), (_, b) in zip(
        full_model.state_dict().items(), resumed_model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_learn(corpus: Any, tmp_path: Path) -> None:
    out = tmp_path / "two"
    argv = ["--quick", "--ranks", "2", "--epochs", "2", "--threads", "1", "--sample", "0", "--out", str(out)]
    config = example.config_of(example.parse(argv))
    assert config == attrs.evolve(QUICK, epochs=2)
    _, state = example.train(
        config,
        corpus,
        out=out,
        ranks=2,
        precision="bf16",
        reporters=[],
        launch_command=[sys.executable, str(EXAMPLE / "train.py"), *argv],
    )
    losses = curve(state)
    assert len(losses) == 2
    assert losses[-1] < losses[0] - 0.2, losses
    latest = lamploop.latest_checkpoint(out)
    assert latest is not None
    assert latest.name == "epoch-000002"


def test_command_line_prints_losses_and_a_sample(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--quick", "--epochs", "1", "--steps-per-epoch", "4", "--sample", "30", "--out", str(tmp_path)]
    assert example.main(argv) == 0
    out = capsys.readouterr().out
    assert "1 rank(s), precision bf16" in out
    assert "epoch 0: train loss" in out
    sample = out.split("is chance):\n", 1)[1]
    assert sample.startswith("def ")
    assert len(sample) == len("def ") + 30 + 1  # the prompt, 30 generated characters, print's newline
    assert (tmp_path / "latest").is_file()
