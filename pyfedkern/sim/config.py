"""What an experiment runs: :class:`ExperimentConfig` (saved as config.json) and the checks of its fields.

Importing this module is cheap (no torch): the command line reads the defaults from it to answer ``--help`` quickly.
:meth:`ExperimentConfig.validate` imports the data, model and algorithm registries it checks against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from pyfedkern.data.spec import parse_spec

LR_SCHEDULES = ("const", "exp", "invsqrt")


@dataclass
class ExperimentConfig:
    """Everything that defines an experiment; saved as config.json next to its results.

    lr_schedule: "const" (η_t = lr), "exp:γ" (η_t = lr·γ^t, FedSpeed) or "invsqrt:c" (η_t = lr/√(t/c + 1), FedPBC),
    with t the 0-based round. local_steps, when set, overrides local_epochs. threads: CPU threads of torch and
    pyfedkern during the run (None: 1 for models under 1M parameters, whose tiny ops only lose time to threading
    overhead, else torch's default). eval_train_max caps the training
    samples used to measure the global model's train loss (a fixed seeded subset when the train set is larger).
    """

    algorithm: str = "fedavg"
    algorithm_params: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_root: str | None = None
    normalize: str = "standard"
    parity: bool = False
    partition: str = "dirichlet:0.3"
    clients: int = 20
    model: str = "mlp"
    model_params: dict[str, Any] = field(default_factory=dict)
    rounds: int = 50
    fraction: float = 1.0
    batch_size: int = 32
    local_epochs: float = 1.0
    local_steps: int | None = None
    lr: float = 0.1
    lr_schedule: str = "const"
    momentum: float = 0.0
    weight_decay: float = 0.0
    eval_every: int = 1
    eval_train_max: int = 10_000
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 10
    threads: int | None = None

    def validate(self) -> None:
        """Raise ValueError for invalid settings, before any work starts (no data is loaded).

        More clients than training samples is caught here for datasets whose size is known without loading them
        (digits, synthetic, quadratic), and otherwise by :class:`Simulation` right after loading.
        """

        from pyfedkern import models
        from pyfedkern.algorithms import make_algorithm
        from pyfedkern.data import datasets, partitions

        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

        def finite(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return value

        for name in ("clients", "rounds", "batch_size", "eval_every", "checkpoint_every", "eval_train_max"):
            positive_int(name, getattr(self, name))
        for name in ("local_steps", "threads"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if isinstance(self.seed, bool) or not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not (0 < finite("fraction", self.fraction) <= 1):
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        for name in ("local_epochs", "lr"):
            if finite(name, getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay"):
            if finite(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.momentum >= 1:
            raise ValueError(f"momentum must be < 1, got {self.momentum}")
        parse_lr_schedule(self.lr_schedule)
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.normalize not in datasets.NORMALIZATIONS:
            raise ValueError(f"normalize must be one of {', '.join(datasets.NORMALIZATIONS)}, got {self.normalize!r}")
        samples = datasets.train_size(self.dataset)
        partitions.parse_partition(self.partition, self.clients)
        if samples is not None:
            check_client_count(self.clients, samples, self.dataset)
        if self.model not in models.MODELS:
            raise ValueError(f"unknown model {self.model!r}; valid choices: {', '.join(sorted(models.MODELS))}")
        make_algorithm(self.algorithm, **self.algorithm_params)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExperimentConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)


def check_client_count(clients: int, samples: int, dataset: str) -> None:
    """ValueError unless every one of ``clients`` clients can get at least one of ``samples`` training samples."""
    if clients > samples:
        raise ValueError(
            f"clients={clients} is more than the {samples} training samples of dataset {dataset!r}; use fewer clients"
        )


def parse_lr_schedule(text: str) -> tuple[str, float]:
    name, args = parse_spec(text, what="lr_schedule", choices=LR_SCHEDULES)
    if name == "const":
        if args:
            raise ValueError(f"lr_schedule 'const' takes no argument, got {text!r}")
        return name, 0.0
    if len(args) != 1:
        raise ValueError(f"lr_schedule {name!r} needs one argument, e.g. '{name}:0.99', got {text!r}")
    value = args[0]
    if name == "exp" and not (0 < value <= 1):
        raise ValueError(f"lr_schedule exp:γ needs γ in (0, 1], got {value}")
    if name == "invsqrt" and not value > 0:
        raise ValueError(f"lr_schedule invsqrt:c needs c > 0, got {value}")
    return name, value
