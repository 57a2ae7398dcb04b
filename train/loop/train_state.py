"""What the training has done so far, saved in every checkpoint's ``trainer_state``.

torchtitan's ``TrainState`` in our terms: the step, the tokens seen, the non-finite steps
skipped and the W&B run the chain's jobs log to. The data stream's position is saved beside it
(``train.data.stream``), the weights, optimizer and RNG by the checkpoint itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0  # loss targets over every data-parallel rank
    nonfinite_steps: int = 0  # steps skipped for a non-finite loss or gradient norm
    wandb_run_id: str | None = None  # every job of a chain logs to this W&B run

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.step = int(saved["step"])
        self.tokens_seen = int(saved["tokens_seen"])
        self.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
        self.wandb_run_id = saved.get("wandb_run_id")
