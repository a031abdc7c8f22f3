"""Whole FedAvg rounds on real models: pfl-research's CIFAR-10 cross-device benchmark and a LEAF-shaped
Shakespeare task, pyfedkern's local-training paths against each other and against pfl-research, at 1 and 2 threads.

- ``engine_models cifar10-shaped 1000×50 simple_cnn fedavg 50/round B=10 cpu t={1,2}``: pfl's headline setup on
  synthetic CIFAR-shaped data generated here (1,000 users × 50 images of 3×32×32, ten classes, each class a fixed
  random image plus noise), pfl's ``simple_cnn`` (:class:`~pyfedkern.models.SimpleCNN`, 1.63 M parameters, 16.8 M
  multiply-adds a sample, dropout on), 50 clients a round, one local epoch of batch 10 (5 steps), lr 0.1; seconds
  per round, no evaluation. Cases: "pyfedkern (engine's choice)" (the path :func:`~pyfedkern.algorithms.batched.
  choose_path` takes, measured once when the case is built), "pyfedkern per-client loop" (``batched=False``),
  "pyfedkern batched" (``batched=True``), at 2 threads "pyfedkern 2 workers × 1 thread" (the engine's choice
  spread over two gloo processes of one thread each, as ``pyfedkern run --workers 2`` does: the same two cores used
  as processes), "pfl 0.6" when ``pfl`` is installed (its ``SimulatedBackend`` with
  ``FederatedAveraging`` on the same arrays, initial model and participants: an optional peer), and the machine's
  limits:
  "limit:gemm" (a float32 GEMM of 1,024³), "limit:conv batch 10" (forward and backward of the CNN's second
  convolution, 86 % of its multiply-adds, on a batch of 10) and "limit:bare steps" (a round's 250 local steps as
  a plain training loop: one model, one cached batch, forward, cross-entropy, ``torch.autograd.grad`` and the SGD
  update, nothing else: the floor of any per-client loop on torch's kernels, pfl's included; at 2 threads also
  split over two processes of one thread each, the floor of "2 workers"). Flops: a round's
  forward and backward of 2,500 images (3 × 2 × 16.8 M × 2,500 ≈ 252 GFLOP), so the report gives each case's
  GFLOP/s next to the limits'.
- ``engine_models shakespeare-shaped 715 users lstm fedavg 10/round B=10 cpu t={1,2}``: LEAF's Shakespeare task
  shape on synthetic text (715 users, 80-character windows over an 80-symbol alphabet drawn from a random Markov
  chain, next-character labels, log-normal user sizes with median 60 and at most 400 windows), LEAF's model
  (:class:`~pyfedkern.models.CharLSTM`: embedding 8, two LSTM layers of 256), 10 clients a round, one local epoch
  of batch 10, lr 0.8; the same pyfedkern cases.

pyfedkern's rounds run in the engine (:func:`array_simulation`: an :class:`~pyfedkern.Experiment` on in-memory
arrays whose clients own consecutive slices of the data), as a user's run does; pfl trains the participants the
engine draws for the same round. Each timed call is the next round of one long run.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pyfedkern.benchmarks.common import Case
from pyfedkern.benchmarks.distributed import WorkerRounds, serve_calls, worker_rounds

if TYPE_CHECKING:
    from pyfedkern.sim.engine import Simulation

THREADS = (1, 2)
CIFAR = {"users": 1000, "per_user": 50, "per_round": 50, "batch": 10, "lr": 0.1}
QUICK_CIFAR = {"users": 60, "per_user": 50, "per_round": 6, "batch": 10, "lr": 0.1}
SHAKESPEARE = {"users": 715, "per_round": 10, "batch": 10, "lr": 0.8, "length": 80, "vocab": 80}
QUICK_SHAKESPEARE = {"users": 40, "per_round": 4, "batch": 10, "lr": 0.8, "length": 20, "vocab": 20, "hidden": 32}
#: multiply-adds of one sample's forward pass through simple_cnn on 3×32×32 (conv1, conv2, fc1, fc2)
SIMPLE_CNN_MACS = 30 * 30 * 32 * 27 + 28 * 28 * 64 * 288 + 12544 * 128 + 128 * 10


def array_simulation(
    module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    sizes: np.ndarray,
    *,
    per_round: int,
    batch_size: int,
    lr: float,
    local_epochs: float = 1.0,
    batched: bool | None = None,
    seed: int = 0,
    **options: Any,
) -> Simulation:
    """The engine (an :class:`~pyfedkern.Experiment`'s simulation) running FedAvg on in-memory arrays: client c owns
    the ``sizes[c]`` samples after those of clients 0..c-1 of x [n, ...] and y [n]; ``per_round`` clients a round,
    pfl's fixed batch order, no evaluation before the rounds, the module's dtype. ``batched`` None lets the engine
    choose the path (:func:`~pyfedkern.algorithms.paths.choose_path`); ``options``: more :class:`Experiment`
    keywords (e.g. central DP's)."""
    from pyfedkern.sim.experiment import Experiment

    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    clients = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    dtype = next(module.parameters()).dtype
    return Experiment(
        module,
        (x, y),
        (x[:batch_size], y[:batch_size]),
        clients=clients,
        fraction=per_round / len(clients),
        batch_size=batch_size,
        lr=lr,
        local_epochs=local_epochs,
        batched=batched,
        seed=seed,
        eval_initial=False,
        batch_order="fixed",
        dtype="float64" if dtype == torch.float64 else "float32",
        **options,
    ).simulation


def cifar_shaped(users: int, per_user: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(x float32 [users·per_user, 3, 32, 32], y int64, sizes): ten classes, each a fixed random image plus unit
    noise, labels drawn uniformly; user after user, ``per_user`` images each."""
    gen = torch.Generator().manual_seed(seed)
    n = users * per_user
    templates = torch.randn(10, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    x = torch.randn(n, 3, 32, 32, generator=gen).add_(templates[y])
    return x, y, np.full(users, per_user, dtype=np.int64)


def shakespeare_shaped(
    users: int, length: int, vocab: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(x int64 [n, length] windows, y int64 [n] the next symbol, sizes [users]) of text drawn from one random
    Markov chain over ``vocab`` symbols (each row of its transition matrix a Dirichlet(0.1) draw); user sizes
    log-normal with median 60, between 2 and 400 windows."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(np.round(rng.lognormal(math.log(60), 1.0, users)), 2, 400).astype(np.int64)
    cumulative = np.cumsum(rng.dirichlet(np.full(vocab, 0.1), size=vocab), axis=1)
    n = int(sizes.sum())
    text = np.empty((n, length + 1), dtype=np.int64)
    text[:, 0] = rng.integers(0, vocab, n)
    for i in range(1, length + 1):
        u = rng.random(n)[:, None]
        text[:, i] = np.minimum((u > cumulative[text[:, i - 1]]).sum(1), vocab - 1)
    return torch.from_numpy(text[:, :-1].copy()), torch.from_numpy(text[:, -1].copy()), sizes


@functools.cache
def task(name: str, quick: bool) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor, torch.Tensor, np.ndarray], dict]:
    """(model factory (seeded: the same initial model at every call), (x, y, sizes), settings) of the "cifar" or
    "text" task; the data is generated once per process."""
    from pyfedkern import models

    if name == "cifar":
        settings = QUICK_CIFAR if quick else CIFAR
        data = cifar_shaped(settings["users"], settings["per_user"])
        shape, classes, kwargs = (3, 32, 32), 10, {}
        model = "simple_cnn"
    else:
        settings = QUICK_SHAKESPEARE if quick else SHAKESPEARE
        data = shakespeare_shaped(settings["users"], settings["length"], settings["vocab"])
        shape, classes, kwargs = (settings["length"],), settings["vocab"], {"hidden": settings.get("hidden", 256)}
        model = "lstm"

    def factory() -> nn.Module:
        torch.manual_seed(0)
        return models.build_model(model, shape, classes, **kwargs)

    return factory, data, settings


def task_simulation(name: str, quick: bool, batched: bool | None, **options: Any) -> Simulation:
    """The engine on task ``name`` (:func:`task`, :func:`array_simulation` with ``options``)."""
    factory, data, settings = task(name, quick)
    return array_simulation(
        factory(),
        *data,
        per_round=settings["per_round"],
        batch_size=settings["batch"],
        lr=settings["lr"],
        batched=batched,
        **options,
    )


def fedavg_rounds(sim: Simulation, threads: int) -> Callable[[], torch.Tensor]:
    """A callable running the next FedAvg round of ``sim`` with ``threads`` CPU threads; returns the global model.
    The engine's path choice (when not forced) is made here, under the same thread count, before any timing."""
    from pyfedkern.sim.engine import _cpu_threads

    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    rounds = itertools.count()
    with _cpu_threads(threads):
        sim.channels_last  # noqa: B018 (the engine's choices of path and layout, measured now, not in a timed round)

    def run() -> torch.Tensor:
        with _cpu_threads(threads):
            algo.round(next(rounds), sim)
        return algo.global_model()

    return run


def pfl_available() -> bool:
    try:
        import pfl  # noqa: F401
    except ImportError:
        return False
    return True


class _PflModule(nn.Module):
    """A module with the ``loss`` and ``metrics`` methods pfl's PyTorchModel calls (cross-entropy, as pfl's
    benchmarks define them)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.train(not eval)
        return nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict[str, Any]:
        from pfl.metrics import Weighted

        self.train(not eval)
        out = self(x)
        loss = nn.functional.cross_entropy(out, y, reduction="sum").item()
        return {"loss": Weighted(loss, len(y)), "accuracy": Weighted((out.argmax(1) == y).sum().item(), len(y))}


class PflRounds:
    """pfl-research (``pfl`` 0.6) running FedAvg on task ``name`` (:func:`task`; the same users, samples and initial
    model as pyfedkern's cases): ``SimulatedBackend`` over a ``FederatedDataset`` (one pfl ``Dataset`` per user),
    ``FederatedAveraging``, ``PyTorchModel`` with local SGD and central SGD of step 1 (plain model averaging); one
    local epoch of the task's batch size (pfl's fixed batch order), no evaluation. :meth:`round` runs the next
    central iteration on the given users (pyfedkern's participants of the same round, so that both train on the
    same amount of data). ``dp`` (clip, σ, noise cohort): pfl's central DP, its ``GaussianMechanism`` (clip, noise
    σ·clip·cohort/noise cohort on the sum, as ``GaussianMechanism.from_privacy_accountant`` sets it) applied
    centrally (``CentrallyAppliedPrivacyMechanism``, a postprocessor of the backend)."""

    def __init__(self, name: str, quick: bool, dp: tuple[float, float, int] | None = None) -> None:
        from dataclasses import replace

        from pfl.aggregate.simulate import SimulatedBackend
        from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
        from pfl.data.dataset import Dataset
        from pfl.data.federated_dataset import FederatedDataset
        from pfl.hyperparam import NNTrainHyperParams
        from pfl.model.pytorch import PyTorchModel
        from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism

        factory, (x, y, sizes), settings = task(name, quick)
        module = _PflModule(factory())
        offsets = np.concatenate([[0], np.cumsum(sizes)])

        def user(uid: int) -> Dataset:
            a, b = int(offsets[uid]), int(offsets[uid + 1])
            return Dataset(raw_data=[x[a:b], y[a:b]], user_id=str(uid))

        self._queue: collections.deque[int] = collections.deque()
        users = FederatedDataset(user, self._queue.popleft)
        postprocessors = []
        if dp is not None:
            clip, sigma, noise_cohort = dp
            mechanism = GaussianMechanism(clip, sigma * settings["per_round"] / noise_cohort)
            postprocessors.append(CentrallyAppliedPrivacyMechanism(mechanism))
        self._backend = SimulatedBackend(training_data=users, val_data=users, postprocessors=postprocessors)
        self._model = PyTorchModel(
            module, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(module.parameters(), 1.0)
        )
        self._params = NNAlgorithmParams(
            central_num_iterations=0,
            evaluation_frequency=1 << 30,
            train_cohort_size=settings["per_round"],
            val_cohort_size=None,
        )
        self._train = NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=settings["lr"], local_batch_size=settings["batch"]
        )
        self._algorithm = FederatedAveraging()
        self._replace = replace

    def round(self, users: list[int]) -> nn.Module:
        """Run the next round on ``users`` (pfl's loop stops after one more central iteration); returns the central
        model."""
        self._queue.extend(users)
        self._params = self._replace(self._params, central_num_iterations=self._params.central_num_iterations + 1)
        self._algorithm.run(self._params, self._backend, self._model, self._train, send_metrics_to_platform=False)
        return self._model.pytorch_model


def pfl_rounds(
    name: str, quick: bool, threads: int, dp: tuple[float, float, int] | None = None
) -> Callable[[], nn.Module]:
    """A callable running the next pfl round (:class:`PflRounds`, with central ``dp`` when given) of task ``name``
    with ``threads`` CPU threads, on the participants pyfedkern's engine draws for that round."""
    from pyfedkern.sim.engine import _cpu_threads

    rounds = PflRounds(name, quick, dp)
    participants = task_simulation(name, quick, False).sample_clients
    count = itertools.count()

    def run() -> nn.Module:
        with _cpu_threads(threads):
            return rounds.round(participants(next(count)).tolist())

    return run


PATHS = {"pyfedkern (engine's choice)": None, "pyfedkern per-client loop": False, "pyfedkern batched": True}


def _task_cases(group: str, name: str, quick: bool, flops: int) -> list[Case]:
    out = []
    for threads in THREADS:
        name_group = f"{group} t={threads}"
        for label, batched in PATHS.items():
            out.append(
                Case(
                    name_group,
                    label,
                    lambda b=batched, t=threads: fedavg_rounds(task_simulation(name, quick, b), t),
                    flops=flops,
                    rounds=3,
                )
            )
        if threads > 1:  # the same cores as processes: one worker per thread, each with one thread
            build = functools.partial(task_simulation, name, quick, None)
            out.append(
                Case(
                    name_group,
                    f"pyfedkern {threads} workers × 1 thread",
                    lambda b=build, t=threads: worker_rounds(b, t),
                    flops=flops,
                    rounds=3,
                )
            )
        if pfl_available():
            out.append(Case(name_group, "pfl 0.6", lambda t=threads: pfl_rounds(name, quick, t), flops=flops, rounds=3))
    return out


def _gemm_limit(threads: int, n: int = 1024) -> Callable[[], Any]:
    from pyfedkern.sim.engine import _cpu_threads

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)

    def run() -> torch.Tensor:
        with _cpu_threads(threads):
            return a @ b

    return run


def _conv_limit(threads: int) -> Callable[[], Any]:
    """Forward and backward (input and weight gradients) of simple_cnn's second convolution on a batch of 10."""
    from pyfedkern.sim.engine import _cpu_threads

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 32, 30, 30, generator=gen, requires_grad=True)
    conv = nn.Conv2d(32, 64, 3)
    grad_out = torch.randn(10, 64, 28, 28, generator=gen)

    def run() -> tuple[torch.Tensor, ...]:
        with _cpu_threads(threads):
            return torch.autograd.grad(conv(x), (x, conv.weight), grad_out)

    return run


def _bare_steps_limit(threads: int, quick: bool, share: int = 1) -> Callable[[], Any]:
    """A round's local steps (participants × 5; with ``share``, that many-th of them) of the CIFAR task as a bare
    loop on one model and one batch of 10; returns the last step's loss."""
    from pyfedkern.sim.engine import _cpu_threads

    factory, (x, y, _), settings = task("cifar", quick)
    model = factory()
    params = list(model.parameters())
    batch = x[: settings["batch"]], y[: settings["batch"]]
    steps = settings["per_round"] * settings["per_user"] // settings["batch"] // share

    def run() -> torch.Tensor:
        with _cpu_threads(threads):
            for _ in range(steps):
                loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for param, grad in zip(params, grads, strict=True):
                        param.sub_(grad, alpha=settings["lr"])
        return loss.detach()

    return run


def _bare_steps_processes(processes: int, quick: bool) -> Callable[[], None]:
    """:func:`_bare_steps_limit` split over ``processes`` plain processes of one thread each, run together: the
    floor of a round spread over that many workers."""
    rounds = WorkerRounds(functools.partial(_bare_steps_limit, 1, quick, processes), processes, serve=serve_calls)
    return rounds.round


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """The CIFAR-10-shaped and Shakespeare-shaped groups at 1 and 2 threads (CPU only)."""
    if device != "cpu":
        return []
    cifar = QUICK_CIFAR if quick else CIFAR
    round_flops = 6 * SIMPLE_CNN_MACS * cifar["per_round"] * cifar["per_user"]  # forward and backward, every image
    out = _task_cases(
        f"engine_models cifar10-shaped {cifar['users']}×{cifar['per_user']} simple_cnn fedavg "
        f"{cifar['per_round']}/round B=10 cpu",
        "cifar",
        quick,
        flops=round_flops,
    )
    for threads in THREADS:
        group = out[-1].group.rsplit(" t=", 1)[0] + f" t={threads}"
        out += [
            Case(group, "limit:gemm", lambda t=threads: _gemm_limit(t), flops=2 * 1024**3),
            Case(group, "limit:conv batch 10", lambda t=threads: _conv_limit(t), flops=6 * 10 * 28 * 28 * 64 * 288),
            Case(
                group,
                "limit:bare steps",
                lambda t=threads: _bare_steps_limit(t, quick),
                flops=round_flops,
                rounds=3,
            ),
        ]
        if threads > 1:
            out.append(
                Case(
                    group,
                    f"limit:bare steps, {threads} processes × 1 thread",
                    lambda t=threads: _bare_steps_processes(t, quick),
                    flops=round_flops,
                    rounds=3,
                )
            )
    text = QUICK_SHAKESPEARE if quick else SHAKESPEARE
    out += _task_cases(
        f"engine_models shakespeare-shaped {text['users']} users lstm fedavg {text['per_round']}/round B=10 cpu",
        "text",
        quick,
        flops=0,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pyfedkern.benchmarks.engine_models [--quick] [WORD ...]``: seconds per round of every case of
    the groups whose name contains every WORD (e.g. ``cifar10 t=1``), the cases of a group timed alternately (round
    after round, five rounds after a warm-up) so that a changing machine load hits them alike."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    quick = "--quick" in args
    words = [a for a in args if a != "--quick"]
    rounds = 2 if quick else 5
    groups: dict[str, list[Case]] = {}
    for case in cases(quick=quick):
        if all(word in case.group for word in words):
            groups.setdefault(case.group, []).append(case)
    for group, members in groups.items():
        runs = {c.name: c.make() for c in members}
        for run in runs.values():
            run()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        print(group)
        best = {name: min(values) for name, values in times.items()}
        loop = best.get("pyfedkern per-client loop")
        pfl = next((c for c in members if c.name == "pfl 0.6"), None)
        for case in members:
            seconds = best[case.name]
            rate = f", {case.flops / seconds / 1e9:.0f} GFLOP/s" if case.flops else ""
            ratio = f", {seconds / loop:.2f}× the loop" if loop and not case.is_limit else ""
            if pfl is not None and case.flops == pfl.flops:  # the same work as pfl's round
                ratio += f", {seconds / best[pfl.name]:.2f}× pfl"
            print(f"  {case.name}: {seconds:.3f} s{rate}{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
