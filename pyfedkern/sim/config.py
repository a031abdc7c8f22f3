"""What an experiment runs: :class:`ExperimentConfig` (saved as config.json) and the checks of its fields.

Importing this module is cheap (no torch): the command line reads the defaults from it to answer ``--help`` quickly.
:meth:`ExperimentConfig.validate` imports the data, model and algorithm registries it checks against.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pyfedkern.data.spec import is_reference, parse_spec

LR_SCHEDULES = ("const", "exp", "invsqrt")
DTYPES = ("float32", "float64")  # of the model and the float data (float64 for checks to rounding)
DTYPE_BYTES = {"float32": 4, "float64": 8}
DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")
INT64_MAX = 2**63 - 1  # the largest count or seed (they become int64 in NumPy, torch and the C++ ops)
#: Copies of the model a run holds at the least (the model, the global model, a client's model and its gradient).
MODEL_COPIES = 4
BATCH_ORDERS = ("reshuffle", "fixed")


DATASETS_HELP = (
    "digits (bundled) | synthetic:α,β[,N[,dim[,classes]]] (Li et al.'s synthetic(α,β): N clients, default 30, each "
    "with its own model; dim 60, 10 classes by default) | synthetic-iid[:N[,dim[,classes]]] (one model for all N "
    "clients) | quadratic:m,d | mnist | cifar10 | leaf (LEAF's JSON files; from --data-root) | your "
    "package.module:factory. With --partition natural --clients N each client holds its own samples"
)
PARTITIONS_HELP = (
    "iid | dirichlet:α | dirichlet-equal:α (equal sizes) | shards:k | quantity:α | noise:σ (IID plus input noise) | "
    "bherd1 | bherd2 | bherd3 | groups:o,α | natural (the dataset's own clients: synthetic, synthetic-iid, quadratic)"
)


def option(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A field of :class:`ExperimentConfig` declared as a run option: its default and help text (see :func:`about`)."""
    return field(default=default, metadata=about(help, flag))


def about(help: str, flag: str | None = None) -> dict[str, Any]:
    """The metadata of a run option's field: its help text and ``flag``, how the command line gives an option it
    parses itself (None: ``--name-with-dashes VALUE``, parsed by the field's type)."""
    return {"help": help, "flag": flag}


@dataclass
class ExperimentConfig:
    """Everything that defines an experiment; saved as config.json next to its results.

    lr_schedule: "const" (η_t = lr), "exp:γ" (η_t = lr·γ^t, FedSpeed) or "invsqrt:c" (η_t = lr/√(t/c + 1), FedPBC),
    with t the 0-based round. local_steps, when set, overrides local_epochs. threads: CPU threads of torch and
    pyfedkern during the run (None: from the work of one batched training step, one thread per 2²² multiply-adds
    up to this process's share of the cores; see Simulation.auto_threads). eval_train_max caps the training
    samples used to measure the global model's train loss (a fixed seeded subset when the train set is larger).
    batched: True: train a round's participants as batched steps (:mod:`pyfedkern.algorithms.batched`; models with
    buffers such as BatchNorm always use the per-client loop); False: a loop over clients (same results to
    rounding); None: the engine takes the faster of the two for the model, device and chunk size
    (:func:`~pyfedkern.algorithms.paths.choose_path`). channels_last: whether the per-client loop feeds image
    batches ([B, C, H, W]) to the model in torch's channels-last memory format (same results to rounding; None: the
    faster of the two layouts for the model, measured once, :func:`~pyfedkern.algorithms.paths.choose_layout`;
    batched steps and other inputs keep the contiguous layout). client_chunk: train at most this many participants at
    once (None: as many as fit a share of the free memory; chunking changes only the order of the server's sums).
    dtype: of the model parameters and the float data, "float32" or "float64".

    model and dataset: a built-in name, or a ``package.module:factory`` reference (see docs/experiments.md); runs
    from Python objects (:class:`~pyfedkern.sim.experiment.Experiment`) store their names here. eval_initial: evaluate
    the initial model (round 0). eval_test_max: evaluate on at most this many test samples (a fixed seeded subset;
    None: all). eval_train_max: 0 skips the train-set evaluation. sample_with_replacement: draw each round's
    clients with replacement (a client drawn twice trains twice and counts twice). batch_order: "reshuffle" (a new
    order each epoch, unless the algorithm asks for a fixed one) or "fixed" (each client keeps one batch order
    across rounds, pfl's default). aggregator: the server's rule for the algorithm's uploaded models ("mean", or a
    robust rule such as "median" or "trimmed:0.1", :mod:`pyfedkern.algorithms.robust`); attack: Byzantine clients,
    ``NAME:fraction[,parameter]`` (:mod:`pyfedkern.algorithms.attacks`), None for none. dp: "central" for
    user-level DP of the server's aggregate (:class:`pyfedkern.privacy.CentralDP`, docs/privacy.md) with dp_clip,
    dp_delta, one of dp_epsilon and dp_noise_multiplier, dp_adaptive_clip (a target quantile), dp_population (the
    sampling rate's denominator; default the clients), dp_noise_cohort and dp_accountant ("rdp" or "pld");
    "local" for record-level DP-SGD in every local step (:class:`pyfedkern.dpsgd.DPSGD`, accounted by
    :class:`pyfedkern.privacy.LocalDP`) with dp_clip (of each sample's gradient), dp_delta, one of dp_epsilon and
    dp_noise_multiplier, dp_accountant, and dp_sampling: "shuffle" (fixed-size batches from a shuffled order) or
    "poisson" (each local step's batch a Poisson sample of the client's data at rate min(B, |D_i|)/|D_i|, divided by
    its expected size; :mod:`pyfedkern.sim.planning`).
    """

    algorithm: str = option(
        "fedavg",
        "algorithm name (`pyfedkern run --algorithm NAME --help-algorithm` lists its parameters), or your "
        "package.module:Class",
        flag="--algorithm",
    )
    algorithm_params: dict[str, Any] = field(
        default_factory=dict, metadata=about("the algorithm's hyper-parameters (its dataclass fields)", "--NAME VALUE")
    )
    dataset: str = option("digits", DATASETS_HELP)
    data_root: str | None = option(None, "directory holding the MNIST / CIFAR-10 files")
    normalize: str = option("standard", "none | unit | standard (per-channel, train statistics)")
    parity: bool = option(False, "even/odd binary task (BHerd's SVM)", flag="--parity")
    partition: str = option("dirichlet:0.3", PARTITIONS_HELP)
    clients: int = option(20, "number of clients")
    model: str = option("mlp", "svm | logreg | mlp | cnn | resnet18 | quadratic, or your package.module:factory")
    model_params: dict[str, Any] = field(
        default_factory=dict,
        metadata=about("model keyword arguments, e.g. hidden=64,64 (repeatable)", "--model-param KEY=VALUE"),
    )
    rounds: int = option(50, "communication rounds")
    fraction: float = option(1.0, "fraction of clients sampled each round, in (0, 1]")
    batch_size: int = option(32, "local minibatch size")
    local_epochs: float = option(1.0, "local epochs per round")
    local_steps: int | None = option(None, "local steps per round (overrides --local-epochs)")
    lr: float = option(0.1, "local learning rate")
    lr_schedule: str = option("const", "const | exp:γ | invsqrt:c (per round)")
    momentum: float = option(0.0, "local SGD momentum")
    weight_decay: float = option(0.0, "local weight decay")
    eval_every: int = option(1, "evaluate the global model every n rounds")
    eval_train_max: int = option(10_000, "measure train loss on at most n training samples (0: skip)")
    seed: int = option(0, "random seed (data split, sampling, init)")
    device: str = option("cpu", "cpu | cuda | cuda:N")
    checkpoint_every: int = option(10, "save a checkpoint every n rounds")
    threads: int | None = option(
        None, "CPU threads for torch and pyfedkern, at most the machine's CPUs (none: from the work of a training step)"
    )
    batched: bool | None = option(
        None,
        "true: train each round's participants as batched steps; false: a loop over clients; auto (default): the "
        "faster of the two for the model, measured once",
    )
    channels_last: bool | None = option(
        None,
        "true: the per-client loop feeds image batches channels-last; false: contiguous; auto (default): the faster "
        "layout for the model, measured once",
    )
    client_chunk: int | None = option(None, "train at most this many participants at once (none: fit free memory)")
    dtype: str = option("float32", "float32 | float64 (model and data)")
    eval_initial: bool = option(
        True, 'evaluate the initial model (round 0; without it round 0\'s record is {"round": 0})'
    )
    eval_test_max: int | None = option(None, "evaluate on at most n test samples (a fixed seeded subset)")
    sample_with_replacement: bool = option(
        False,
        "draw each round's clients with replacement (a client drawn twice trains twice from the same model and counts "
        "twice)",
    )
    batch_order: str = option(
        "reshuffle",
        "reshuffle (a new order each epoch, unless the algorithm asks for a fixed one) | fixed (each client keeps one "
        "batch order across rounds, pfl's default)",
    )
    aggregator: str = option(
        "mean",
        "the server's rule for the uploaded models: mean | median | trimmed:β | krum:f | multikrum:f,m | bulyan:f | "
        "geomed | cclip:τ[,iters] (docs/robust.md)",
    )
    attack: str | None = option(
        None,
        "Byzantine clients: signflip:p | gaussian:p[,σ] | scale:p[,s] | alie:p[,z] | ipm:p[,ε], p the fraction of "
        "each round's clients",
    )
    dp: str | None = option(
        None, "differential privacy: central (user-level) | local (DP-SGD, record-level); docs/privacy.md"
    )
    dp_epsilon: float | None = option(
        None, "DP budget ε over the run (σ solved from it); or give --dp-noise-multiplier"
    )
    dp_delta: float | None = option(None, "DP δ, in (0, 1/population)")
    dp_clip: float | None = option(
        None, "DP clip C (ℓ2) of each client's update (central) or sample's gradient (local)"
    )
    dp_noise_multiplier: float | None = option(None, "DP noise multiplier σ (ε is reported); or --dp-epsilon")
    dp_adaptive_clip: float | None = option(None, "adapt the clip to this quantile of the update norms")
    dp_population: int | None = option(None, "clients the cohorts are drawn from, for accounting (none: --clients)")
    dp_noise_cohort: int | None = option(None, "add the noise of a cohort of N (pfl's noise_cohort_size)")
    dp_accountant: str = option("rdp", "rdp | pld (dp-accounting's)")
    dp_sampling: str = option(
        "shuffle",
        "local DP-SGD's batches: shuffle (fixed-size, from a shuffled order) | poisson (each sample in a step's batch "
        "with probability min(B, |D_i|)/|D_i|, as the accountant assumes)",
    )

    def validate(self) -> None:
        """Raise ValueError for invalid settings, before any work starts (no data is loaded).

        More clients than training samples is caught here for datasets whose size is known without loading them
        (digits, synthetic, quadratic), and otherwise by :class:`~pyfedkern.sim.engine.Simulation` right after
        loading. A ``module:factory`` model or dataset is imported only when the simulation is built.
        """
        from pyfedkern import models
        from pyfedkern.data import datasets, partitions

        self.validate_settings()
        if not is_reference(self.dataset):
            if self.normalize not in datasets.NORMALIZATIONS:
                raise ValueError(
                    f"normalize must be one of {', '.join(datasets.NORMALIZATIONS)}, got {self.normalize!r}"
                )
            samples = datasets.train_size(self.dataset)
            if samples is not None:
                check_client_count(self.clients, samples, self.dataset)
        partitions.parse_partition(self.partition, self.clients)
        if not is_reference(self.model) and self.model not in models.MODELS:
            raise ValueError(
                f"unknown model {self.model!r}; valid choices: {', '.join(sorted(models.MODELS))}, "
                "or package.module:factory"
            )

    def validate_settings(self) -> None:
        """Raise ValueError for invalid run settings (everything but the model, the dataset and its split, which
        a run from Python objects gives itself)."""
        from pyfedkern.algorithms import make_algorithm
        from pyfedkern.algorithms.attacks import parse_attack
        from pyfedkern.algorithms.base import FLOAT32_MAX, check_robust
        from pyfedkern.algorithms.robust import parse_aggregator

        def positive_int(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT64_MAX:
                raise ValueError(f"{name} must be an integer from 1 to 2^63 - 1, got {value!r}")

        def finite(name: str, value: Any) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return value

        for name in ("algorithm", "dataset", "normalize", "partition", "model", "lr_schedule", "device", "aggregator"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("algorithm_params", "model_params"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict, got {getattr(self, name)!r}")
        for name in ("parity", "eval_initial", "sample_with_replacement"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("batched", "channels_last"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"{name} must be true, false or None (the engine chooses), got {getattr(self, name)!r}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("clients", "rounds", "batch_size", "eval_every", "checkpoint_every"):
            positive_int(name, getattr(self, name))
        if isinstance(self.eval_train_max, bool) or not isinstance(self.eval_train_max, int) or self.eval_train_max < 0:
            raise ValueError(
                f"eval_train_max must be an integer >= 0 (0: no train-set evaluation), got {self.eval_train_max!r}"
            )
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order must be one of {', '.join(BATCH_ORDERS)}, got {self.batch_order!r}")
        for name in ("local_steps", "threads", "client_chunk", "eval_test_max"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        check_seed(self.seed)
        if not (0 < finite("fraction", self.fraction) <= 1):
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        for name in ("local_epochs", "lr"):
            if finite(name, getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("momentum", "weight_decay"):
            if finite(name, getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "weight_decay"):  # factors of the model's values
            if getattr(self, name) > FLOAT32_MAX:
                raise ValueError(
                    f"{name} must be within float32's range (at most {FLOAT32_MAX:.4g}), got {getattr(self, name)!r}"
                )
        if self.momentum >= 1:
            raise ValueError(f"momentum must be < 1, got {self.momentum}")
        parse_lr_schedule(self.lr_schedule)
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (N a GPU index), got {self.device!r}")
        algorithm = make_algorithm(self.algorithm, **self.algorithm_params)
        check_robust(type(algorithm), parse_aggregator(self.aggregator), parse_attack(self.attack))
        check_dp(self, type(algorithm))

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict of JSON values (what ``config.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExperimentConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config field(s): {', '.join(unknown)}")
        return cls(**data)


@dataclass(frozen=True)
class Option:
    """A run option: an :class:`ExperimentConfig` field as :func:`option` declared it. ``kind``: its type's name
    ("str", "int", "float", "bool" or "dict"); ``optional``: whether None is a value (unset, or the program
    decides); ``flag``: the command line's spelling; ``parsed``: whether the command line parses it by its kind
    (``--name-with-dashes VALUE``) rather than by its own rule (``--parity``, ``--model-param KEY=VALUE``)."""

    name: str
    kind: str
    optional: bool
    default: Any
    help: str
    flag: str
    parsed: bool

    @property
    def key(self) -> str:
        """The option's key in a Flower run config: the name with ``-`` for ``_``."""
        return self.name.replace("_", "-")


def _options() -> dict[str, Option]:
    out = {}
    for f in dataclasses.fields(ExperimentConfig):
        kind, _, none = str(f.type).partition(" | ")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        own = f.metadata["flag"]
        flag = own or f"--{f.name.replace('_', '-')}"
        out[f.name] = Option(f.name, kind.partition("[")[0], none == "None", default, f.metadata["help"], flag, not own)
    return out


#: Every run option by name, in the order of :class:`ExperimentConfig`'s fields: the command line's ``run`` and
#: ``compare`` options, :class:`~pyfedkern.sim.experiment.Experiment`'s keywords and a Flower run config's keys.
OPTIONS = _options()


def options_table() -> str:
    """The Markdown table of :data:`OPTIONS` that docs/experiments.md holds (tests/sim/test_options.py checks)."""
    rows = ["| option | command line | default | what |", "|---|---|---|---|"]
    for o in OPTIONS.values():
        what = o.help.replace("|", "\\|")
        default = "none" if o.default is None else o.default
        rows.append(f"| `{o.name}` | `{o.flag}` | `{default}` | {what} |")
    return "\n".join(rows) + "\n"


DP_MODES = ("central", "local")
DP_SAMPLINGS = ("shuffle", "poisson")
_DP_OPTIONS = ("epsilon", "delta", "clip", "noise_multiplier", "adaptive_clip", "population", "noise_cohort")
_CENTRAL_OPTIONS = ("adaptive_clip", "population", "noise_cohort")  # mean nothing for local DP-SGD


def check_dp(config: ExperimentConfig, algorithm: type) -> None:
    """ValueError naming the option for differential-privacy settings that are wrong or missing (docs/privacy.md):
    dp must be None, "central" or "local"; both need dp_clip (finite, > 0), dp_delta in (0, 1) and exactly one of
    dp_epsilon (> 0) and dp_noise_multiplier (>= 0). Central DP needs dp_delta below 1/population and an algorithm
    that uploads only its model; local DP-SGD an algorithm whose local steps are plain gradient steps, and it refuses
    central DP's own options (dp_adaptive_clip, dp_population, dp_noise_cohort). dp_sampling="poisson" needs
    dp="local" and the default batch_order."""
    from pyfedkern import privacy

    if config.dp_sampling not in DP_SAMPLINGS:
        raise ValueError(f"dp_sampling must be one of {', '.join(DP_SAMPLINGS)}, got {config.dp_sampling!r}")
    if config.dp_sampling == "poisson" and config.dp != "local":
        raise ValueError(
            f"dp_sampling='poisson' (--dp-sampling) samples local DP-SGD's batches: it needs dp='local' (--dp local), "
            f"got dp={config.dp!r}"
        )
    if config.dp_sampling == "poisson" and config.batch_order == "fixed":
        raise ValueError("dp_sampling='poisson' draws every batch afresh: batch_order='fixed' does not apply")
    if config.dp is None:
        given = [f"dp_{name}" for name in _DP_OPTIONS if getattr(config, f"dp_{name}") is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need dp='central' or dp='local' (--dp central|local)")
        return
    if config.dp not in DP_MODES:
        raise ValueError(f"dp must be one of {', '.join(DP_MODES)} or None, got {config.dp!r}")
    if config.dp_accountant not in privacy.ACCOUNTANTS:
        raise ValueError(f"dp_accountant must be one of {', '.join(privacy.ACCOUNTANTS)}, got {config.dp_accountant!r}")
    if (config.dp_epsilon is None) == (config.dp_noise_multiplier is None):
        raise ValueError(
            f"{config.dp} DP needs exactly one of dp_epsilon (--dp-epsilon) and dp_noise_multiplier "
            "(--dp-noise-multiplier)"
        )
    if config.dp_epsilon is not None and not _real(config.dp_epsilon, lambda v: 0 < v < math.inf):
        raise ValueError(f"dp_epsilon must be a finite number > 0, got {config.dp_epsilon!r}")
    if config.dp_noise_multiplier is not None and not _real(config.dp_noise_multiplier, lambda v: 0 <= v < math.inf):
        raise ValueError(f"dp_noise_multiplier must be a finite number >= 0, got {config.dp_noise_multiplier!r}")
    if config.dp_clip is None or not _real(config.dp_clip, lambda v: 0 < v < math.inf):
        raise ValueError(f"dp_clip (--dp-clip) must be a finite number > 0, got {config.dp_clip!r}")
    if config.dp_delta is None or not _real(config.dp_delta, lambda v: 0 < v < 1):
        raise ValueError(f"dp_delta (--dp-delta) must be in (0, 1), got {config.dp_delta!r}")
    if config.dp == "local":
        given = [f"dp_{name}" for name in _CENTRAL_OPTIONS if getattr(config, f"dp_{name}") is not None]
        if given:
            raise ValueError(f"{', '.join(given)} apply to central DP only (--dp central), not to dp='local'")
        algorithm.check_local_dp()
        return
    if config.dp_adaptive_clip is not None and not _real(config.dp_adaptive_clip, lambda v: 0 < v < 1):
        raise ValueError(f"dp_adaptive_clip must be a quantile in (0, 1), got {config.dp_adaptive_clip!r}")
    for name in ("dp_population", "dp_noise_cohort"):
        value = getattr(config, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    population = config.dp_population or config.clients
    if config.dp_delta >= 1 / population:
        raise ValueError(
            f"dp_delta must be below 1/population = 1/{population} (--dp-population, default the clients), got "
            f"{config.dp_delta!r}"
        )
    algorithm.check_central_dp()


def _real(value: Any, ok: Callable[[float], bool]) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and ok(float(value))


def check_seed(seed: Any) -> None:
    """ValueError unless ``seed`` is an integer from 0 to 2^63 - 1 (a run's seed; also checked before a split)."""
    if isinstance(seed, bool) or not (isinstance(seed, int) and 0 <= seed <= INT64_MAX):
        raise ValueError(f"seed must be an integer from 0 to 2^63 - 1, got {seed!r}")


def check_client_count(clients: int, samples: int, dataset: str) -> None:
    """ValueError unless every one of ``clients`` clients can get at least one of ``samples`` training samples."""
    if clients > samples:
        raise ValueError(
            f"clients={clients} is more than the {samples} training samples of dataset {dataset!r}; use fewer clients"
        )


def check_device(device: str) -> None:
    """ValueError unless ``device`` (a valid config's: "cpu", "cuda" or "cuda:N") can run here (see
    :func:`device_problems`). Not part of :meth:`ExperimentConfig.validate`: a config stays valid on a machine
    without its GPU (to read its results, say); :class:`~pyfedkern.sim.engine.Simulation` checks it before any work."""
    if device == "cpu":
        return
    import torch

    from pyfedkern._runtime import build_info

    problems = device_problems(
        device,
        torch_cuda=torch.backends.cuda.is_built(),
        gpus=torch.cuda.device_count(),
        pyfedkern_cuda=bool(build_info()["cuda"]),
    )
    if problems:
        raise ValueError(f"device {device!r} cannot be used here: {'; '.join(problems)}")


def check_threads(threads: int | None) -> None:
    """ValueError when ``threads`` (a valid config's) is more than this machine's CPUs: more threads than CPUs only
    slow the kernels down, and a huge number exhausts the machine's processes."""
    cpus = os.cpu_count() or 1
    if threads is not None and threads > cpus:
        raise ValueError(f"threads={threads} is more than the {cpus} CPUs of this machine; use at most {cpus}")


def check_data_memory(config: ExperimentConfig, available: int) -> None:
    """ValueError when the data of ``config.dataset`` would not fit in ``available`` bytes (for digits, synthetic
    and quadratic, whose size is known before they are made), saying how many of the dataset's clients (the N of
    synthetic:α,β,N, the m of quadratic:m,d) fit. The estimate counts the dataset's float32 arrays, the run's copy
    of the training set in its dtype (and of all of it in float64), and the labels and indices."""
    from pyfedkern.data import datasets

    if config.dataset.partition(":")[0] not in ("digits", "synthetic", "synthetic-iid", "quadratic"):
        return  # read from files or made by the user's factory: no estimate before loading
    planned = datasets.planned_size(config.dataset)
    if planned is None:
        return
    train, test, shape = planned
    name = parse_spec(config.dataset, what="dataset", choices=datasets.DATASETS)[0]
    if name in ("synthetic", "synthetic-iid"):  # a client's W [dim, classes], b and logits, drawn in float64
        _, dim, classes = datasets.synthetic_shape(config.dataset)
        drawn = 8.0 * classes * (dim + 1 + 1000)
        if drawn > available:
            most = int(available / (8.0 * (dim + 1001)))
            fits = (
                f"{_count(most)} classes fit (a smaller classes)"
                if most >= 2
                else f"{_count(int(available / 16.0) - 1001)} features fit with 2 classes (a smaller dim)"
            )
            raise ValueError(
                f"dataset {config.dataset}: drawing a model of {_count(dim)}×{_count(classes)} values and its logits "
                f"needs about {_size(drawn)} of memory, but {_size(available)} are available; at most about {fits}"
            )
    features, itemsize = math.prod(shape), DTYPE_BYTES[config.dtype]
    needed = features * (4 * (train + test) + itemsize * train + (itemsize * (train + test) if itemsize != 4 else 0))
    needed += 48 * (train + test)  # labels, client ids, sample indices
    if needed <= available:
        return
    fits = ""
    where = {"synthetic": "N in synthetic:α,β,N", "synthetic-iid": "N in synthetic-iid:N"}
    if name in where:  # the samples grow with the number of clients of the spec
        count = datasets.synthetic_shape(config.dataset)[0]
        fitting = _count(int(count * available / needed))
        fits = f"; about {fitting} of its {_count(count)} clients fit (a smaller {where[name]})"
    elif name == "quadratic":  # one sample per client
        fits = f"; about {int(train * available / needed):,} of its {train:,} clients fit (a smaller m)"
    raise ValueError(
        f"dataset {config.dataset} ({_count(train + test)} samples of {_count(features)} values) needs about "
        f"{_size(needed)} of memory in this run, but {_size(available)} are available{fits}"
    )


def check_model_memory(config: ExperimentConfig, build: Callable[[], Any], available: int) -> None:
    """ValueError when :data:`MODEL_COPIES` copies of ``config.model`` (``build()`` on PyTorch's meta device, which
    allocates nothing) would not fit in ``available`` bytes, saying how many parameters fit."""
    import torch

    given = ", ".join(f"{k}={_shown(v)}" for k, v in config.model_params.items())
    model = f"model {config.model}{f' with {given}' if given else ''}"
    fits = f"at most about {available // (MODEL_COPIES * DTYPE_BYTES[config.dtype]):,} parameters fit"
    try:
        with torch.device("meta"):
            module = build()
    except RuntimeError:  # a layer of more than 2^63 bytes
        raise ValueError(f"{model} has layers too large for any memory; {fits}") from None
    params = sum(p.numel() for p in module.parameters())
    needed = MODEL_COPIES * params * DTYPE_BYTES[config.dtype]
    if needed > available:
        raise ValueError(
            f"{model} has {params:,} parameters; the run holds at least {MODEL_COPIES} copies of them (the model, "
            f"the global model, a client's model and its gradient), {_size(needed)} in {config.dtype}, but "
            f"{_size(available)} are available: {fits}"
        )


def check_local_work(config: ExperimentConfig, client_sizes: Any, available: int) -> None:
    """ValueError when the minibatch plan of a round (the sample positions of every local step of the round's
    participants, the largest clients taken) would not fit in ``available`` bytes, naming --local-steps or
    --local-epochs and the most that fits. Counted in floats, so 1e300 epochs are refused, not overflowed."""
    import numpy as np

    n = np.sort(np.asarray(client_sizes, dtype=np.float64))[::-1]
    n = n[: max(1, round(config.fraction * len(n)))]
    size = np.minimum(float(config.batch_size), n)
    per_epoch = np.ceil(n / size)

    def plan(steps_or_epochs: float) -> tuple[float, float]:
        """(local steps, bytes) of a round's plan."""
        steps = np.full_like(n, steps_or_epochs) if config.local_steps else np.ceil(steps_or_epochs * per_epoch)
        drawn = np.ceil(steps / per_epoch)  # permutations of the client's data
        return float(np.sum(steps)), 8 * float(np.sum(drawn * n + steps * size + 10 * steps))

    option = "local_steps" if config.local_steps else "local_epochs"
    value = getattr(config, option)
    steps, needed = plan(value)
    if needed <= available:
        return
    most = value * (available / needed)
    while most > 0 and plan(most)[1] > available:  # the rounding up of steps: a little less
        most = int(most * 0.95) if config.local_steps else most * 0.95
    fits = f"{int(most):,}" if config.local_steps else f"{most:.3g}"
    raise ValueError(
        f"{option}={value:,} makes {steps:.3g} local steps a round ({len(n)} participants); planning their "
        f"minibatches needs about {_size(needed)}, but {_size(available)} are available: at most about "
        f"{option}={fits} fits"
    )


def _size(nbytes: float) -> str:
    """Bytes in GiB, or MiB or KiB below 1 GiB."""
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if nbytes >= s or u == "KiB")
    amount = nbytes / scale
    return f"{amount:,.1f} {unit}" if amount < 1e6 else f"{amount:.3g} {unit}"


def _count(n: int) -> str:
    """``n`` with thousands separators, or as 1.23e+45 beyond 15 digits."""
    return f"{n:,}" if n < 10**15 else f"{n:.3g}"


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def device_problems(device: str, *, torch_cuda: bool, gpus: int, pyfedkern_cuda: bool) -> list[str]:
    """Why the CUDA device ``device`` ("cuda" or "cuda:N") cannot run an experiment, given the facts: whether the
    installed torch was built with CUDA, how many GPUs it sees, and whether pyfedkern was built with CUDA. Empty
    when it can."""
    problems = []
    if not torch_cuda:
        problems.append("the installed torch was built without CUDA (install a CUDA build of torch)")
    if not pyfedkern_cuda:
        problems.append("pyfedkern was built without CUDA (reinstall it with PYFEDKERN_CUDA=ON where nvcc is found)")
    index = int(device.partition(":")[2] or 0)
    if torch_cuda and gpus == 0:
        problems.append("no CUDA GPU is visible (torch.cuda.device_count() is 0)")
    elif torch_cuda and index >= gpus:
        problems.append(f"GPU index {index} is out of range: {gpus} GPU(s) visible, cuda:0 to cuda:{gpus - 1}")
    return problems


#: Environment variable set in the processes that ``--workers`` starts (their parent reports an interruption).
LAUNCHED_BY_WORKERS = "PYFEDKERN_WORKER"


def launched() -> bool:
    """Whether this process was started by torchrun (or ``--workers``): the env:// rendezvous variables are set."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def local_world_size() -> int:
    """Processes of this run on this machine (LOCAL_WORLD_SIZE; 1 outside a launch)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched() else 1


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
    if name == "invsqrt" and not (math.isfinite(value) and value > 0):
        raise ValueError(f"lr_schedule invsqrt:c needs a finite c > 0, got {value}")
    return name, value
