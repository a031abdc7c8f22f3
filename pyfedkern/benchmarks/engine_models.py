"""Whole FedAvg rounds on real models: pfl-research's CIFAR-10 cross-device benchmark and a LEAF-shaped
Shakespeare task, pyfedkern's local-training paths against each other and against pfl-research, at 1 and 2 threads.

- ``engine_models cifar10-shaped 1000×50 simple_cnn fedavg 50/round B=10 cpu t={1,2}``: pfl's headline setup on
  synthetic CIFAR-shaped data generated here (1,000 users × 50 images of 3×32×32, ten classes, each class a fixed
  random image plus noise), pfl's ``simple_cnn`` (:class:`~pyfedkern.models.SimpleCNN`, 1.63 M parameters, 16.8 M
  multiply-adds a sample, dropout on), 50 clients a round, one local epoch of batch 10 (5 steps), lr 0.1; seconds
  per round, no evaluation. Cases: "pyfedkern (engine's choice)" (the path :func:`~pyfedkern.algorithms.batched.
  choose_path` takes, measured once when the case is built), "pyfedkern per-client loop" (``batched=False``),
  "pyfedkern batched" (``batched=True``), "pfl 0.6" when ``pfl`` is installed (its ``SimulatedBackend`` with
  ``FederatedAveraging`` on the same arrays and users, torch model; an optional peer), and the machine's limits:
  "limit:gemm" (a float32 GEMM of 1,024³) and "limit:conv batch 10" (forward and backward of the CNN's second
  convolution, 86 % of its multiply-adds, on a batch of 10). Flops: a round's forward and backward of 2,500 images
  (3 × 2 × 16.8 M × 2,500 ≈ 252 GFLOP), so the report gives each case's GFLOP/s next to the limits'.
- ``engine_models shakespeare-shaped 715 users lstm fedavg 10/round B=10 cpu t={1,2}``: LEAF's Shakespeare task
  shape on synthetic text (715 users, 80-character windows over an 80-symbol alphabet drawn from a random Markov
  chain, next-character labels, log-normal user sizes with median 60 and at most 400 windows), LEAF's model
  (:class:`~pyfedkern.models.CharLSTM`: embedding 8, two LSTM layers of 256), 10 clients a round, one local epoch
  of batch 10, lr 0.8; the same pyfedkern cases.

The rounds run on :class:`ArrayContext`, an :class:`~pyfedkern.algorithms.FLContext` over in-memory arrays whose
clients own consecutive slices of the data; each timed call is the next round of one long run.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from pyfedkern.benchmarks.common import Case

THREADS = (1, 2)
CIFAR = {"users": 1000, "per_user": 50, "per_round": 50, "batch": 10, "lr": 0.1}
QUICK_CIFAR = {"users": 60, "per_user": 50, "per_round": 6, "batch": 10, "lr": 0.1}
SHAKESPEARE = {"users": 715, "per_round": 10, "batch": 10, "lr": 0.8, "length": 80, "vocab": 80}
QUICK_SHAKESPEARE = {"users": 40, "per_round": 4, "batch": 10, "lr": 0.8, "length": 20, "vocab": 20, "hidden": 32}
#: multiply-adds of one sample's forward pass through simple_cnn on 3×32×32 (conv1, conv2, fc1, fc2)
SIMPLE_CNN_MACS = 30 * 30 * 32 * 27 + 28 * 28 * 64 * 288 + 12544 * 128 + 128 * 10


class ArrayContext:
    """An :class:`~pyfedkern.algorithms.FLContext` over in-memory arrays: client c owns samples
    ``offsets[c]:offsets[c + 1]`` of x [n, ...] and y [n]; FedAvg-style settings (no momentum or weight decay).

    Minibatches: each epoch a seeded permutation of the client's samples (stream (seed, 2, t, c, epoch)), cut into
    batches of ``batch_size`` (the last one shorter); ``order="fixed"`` keeps one permutation per client. Rounds
    sample ``per_round`` clients without replacement (stream (seed, 1, t)). ``batched`` None lets
    :func:`~pyfedkern.algorithms.batched.choose_path` pick the path at the first round, as the engine does.
    """

    def __init__(
        self,
        module: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        sizes: np.ndarray,
        *,
        per_round: int,
        batch_size: int,
        lr: float,
        local_epochs: float = 1.0,
        seed: int = 0,
        batched: bool | None = None,
    ) -> None:
        from pyfedkern.algorithms import LocalModel

        sizes = np.asarray(sizes, dtype=np.int64)
        if x.shape[0] != y.shape[0] or x.shape[0] != int(sizes.sum()) or np.any(sizes < 1):
            raise ValueError(f"x and y must hold sum(sizes) = {int(sizes.sum())} samples, every client at least one")
        self.local = LocalModel(module)
        self.x, self.y = x, y
        self.client_sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.num_clients = len(sizes)
        self.per_round = min(int(per_round), self.num_clients)
        self.device = x.device
        self.batch_size, self.local_epochs, self.local_steps = batch_size, local_epochs, None
        self.momentum = self.weight_decay = 0.0
        self.client_chunk = None
        self.sample_input = x[0]
        self.seed = seed
        self._lr = lr
        self._batched = batched

    @property
    def batched(self) -> bool:
        """The configured path, or the one :func:`~pyfedkern.algorithms.batched.choose_path` measures faster."""
        if self._batched is None:
            from pyfedkern.algorithms.batched import choose_path

            self._batched = choose_path(self, self.per_round).batched
        return self._batched

    def lr(self, t: int) -> float:
        return self._lr

    def rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *(int(k) for k in keys)])

    @contextlib.contextmanager
    def timer(self, category: str) -> Iterator[None]:
        yield

    def sample_clients(self, t: int) -> np.ndarray:
        return np.sort(self.rng(1, t).choice(self.num_clients, self.per_round, replace=False))

    def batches(
        self,
        cid: int,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = int(self.client_sizes[cid])
        size = min(batch_size or self.batch_size, n)
        per_epoch = n // size if drop_last else -(-n // size)
        if steps is None:
            work = (self.local_epochs if epochs is None else epochs) * n / size
            steps = int(math.floor(work + 1e-9) if drop_last else math.ceil(work - 1e-9))
        first = int(self.offsets[cid])
        for step in range(steps):
            epoch, b = divmod(step, per_epoch)
            keys = (3, cid) if order == "fixed" else (2, t, cid, epoch)
            perm = self.rng(*keys).permutation(n)[b * size : (b + 1) * size]
            idx = torch.as_tensor(first + perm, device=self.device)
            yield self.x[idx], self.y[idx]


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


def fedavg_rounds(ctx: ArrayContext, threads: int) -> Callable[[], torch.Tensor]:
    """A callable running the next FedAvg round on ``ctx`` with ``threads`` CPU threads; returns the global model.
    The path choice (when ``ctx.batched`` is None) is made here, under the same thread count, before any timing."""
    from pyfedkern.algorithms.fedavg import FedAvg
    from pyfedkern.sim.engine import _cpu_threads

    algo = FedAvg()
    algo.setup(ctx, ctx.local.flat.data.clone())
    rounds = itertools.count()
    with _cpu_threads(threads):
        ctx.batched  # noqa: B018 (the engine's choice, measured now rather than in a timed round)

    def run() -> torch.Tensor:
        with _cpu_threads(threads):
            algo.round(next(rounds), ctx)
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
    """pfl-research (``pfl`` 0.6) running FedAvg on an :class:`ArrayContext`'s users and a copy of its initial
    model: ``SimulatedBackend`` over a ``FederatedDataset`` (one pfl ``Dataset`` per user, the same samples),
    ``FederatedAveraging``, ``PyTorchModel`` with local SGD and central SGD of step 1 (plain model averaging);
    one local epoch of the context's batch size (pfl's fixed batch order), ``per_round`` users a round drawn by
    pfl's ``minimize_reuse`` sampler, no evaluation. :meth:`round` runs the next central iteration."""

    def __init__(self, ctx: ArrayContext) -> None:
        import copy
        from dataclasses import replace

        from pfl.aggregate.simulate import SimulatedBackend
        from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
        from pfl.data.dataset import Dataset
        from pfl.data.federated_dataset import FederatedDataset
        from pfl.data.sampling import get_user_sampler
        from pfl.hyperparam import NNTrainHyperParams
        from pfl.model.pytorch import PyTorchModel

        module = _PflModule(copy.deepcopy(ctx.local.module))
        offsets = ctx.offsets

        def user(uid: int) -> Dataset:
            a, b = int(offsets[uid]), int(offsets[uid + 1])
            return Dataset(raw_data=[ctx.x[a:b], ctx.y[a:b]], user_id=str(uid))

        users = FederatedDataset(user, get_user_sampler("minimize_reuse", list(range(ctx.num_clients))))
        self._backend = SimulatedBackend(training_data=users, val_data=users)
        self._model = PyTorchModel(
            module, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(module.parameters(), 1.0)
        )
        self._params = NNAlgorithmParams(
            central_num_iterations=0,
            evaluation_frequency=1 << 30,
            train_cohort_size=ctx.per_round,
            val_cohort_size=None,
        )
        self._train = NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=ctx.lr(0), local_batch_size=ctx.batch_size
        )
        self._algorithm = FederatedAveraging()
        self._replace = replace

    def round(self) -> nn.Module:
        """Run the next round (pfl's loop stops after one more central iteration); returns the central model."""
        self._params = self._replace(self._params, central_num_iterations=self._params.central_num_iterations + 1)
        self._algorithm.run(self._params, self._backend, self._model, self._train, send_metrics_to_platform=False)
        return self._model.pytorch_model


def pfl_rounds(ctx: ArrayContext, threads: int) -> Callable[[], nn.Module]:
    """A callable running the next pfl round (:class:`PflRounds`) on ``ctx``'s task with ``threads`` CPU threads."""
    from pyfedkern.sim.engine import _cpu_threads

    rounds = PflRounds(ctx)

    def run() -> nn.Module:
        with _cpu_threads(threads):
            return rounds.round()

    return run


PATHS = {"pyfedkern (engine's choice)": None, "pyfedkern per-client loop": False, "pyfedkern batched": True}


def _task_cases(group: str, build: Callable[[bool | None], ArrayContext], flops: int) -> list[Case]:
    out = []
    for threads in THREADS:
        name_group = f"{group} t={threads}"
        for name, batched in PATHS.items():
            out.append(
                Case(name_group, name, lambda b=batched, t=threads: fedavg_rounds(build(b), t), flops=flops, rounds=3)
            )
        if pfl_available():
            out.append(
                Case(name_group, "pfl 0.6", lambda t=threads: pfl_rounds(build(False), t), flops=flops, rounds=3)
            )
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


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """The CIFAR-10-shaped and Shakespeare-shaped groups at 1 and 2 threads (CPU only)."""
    if device != "cpu":
        return []
    from pyfedkern import models

    cifar = QUICK_CIFAR if quick else CIFAR
    data: dict[str, Any] = {}

    def cifar_ctx(batched: bool | None) -> ArrayContext:
        if "cifar" not in data:
            data["cifar"] = cifar_shaped(cifar["users"], cifar["per_user"])
        torch.manual_seed(0)
        module = models.build_model("simple_cnn", (3, 32, 32), 10)
        return ArrayContext(
            module,
            *data["cifar"],
            per_round=cifar["per_round"],
            batch_size=cifar["batch"],
            lr=cifar["lr"],
            batched=batched,
        )

    text = QUICK_SHAKESPEARE if quick else SHAKESPEARE

    def text_ctx(batched: bool | None) -> ArrayContext:
        if "text" not in data:
            data["text"] = shakespeare_shaped(text["users"], text["length"], text["vocab"])
        torch.manual_seed(0)
        module = models.build_model("lstm", (text["length"],), text["vocab"], hidden=text.get("hidden", 256))
        return ArrayContext(
            module, *data["text"], per_round=text["per_round"], batch_size=text["batch"], lr=text["lr"], batched=batched
        )

    samples = cifar["per_round"] * cifar["per_user"]
    out = _task_cases(
        f"engine_models cifar10-shaped {cifar['users']}×{cifar['per_user']} simple_cnn fedavg "
        f"{cifar['per_round']}/round B=10 cpu",
        cifar_ctx,
        flops=6 * SIMPLE_CNN_MACS * samples,
    )
    for threads in THREADS:
        group = out[-1].group.rsplit(" t=", 1)[0] + f" t={threads}"
        out += [
            Case(group, "limit:gemm", lambda t=threads: _gemm_limit(t), flops=2 * 1024**3),
            Case(group, "limit:conv batch 10", lambda t=threads: _conv_limit(t), flops=6 * 10 * 28 * 28 * 64 * 288),
        ]
    out += _task_cases(
        f"engine_models shakespeare-shaped {text['users']} users lstm fedavg {text['per_round']}/round B=10 cpu",
        text_ctx,
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
        for case in members:
            seconds = best[case.name]
            rate = f", {case.flops / seconds / 1e9:.0f} GFLOP/s" if case.flops else ""
            ratio = f", {seconds / loop:.2f}× the loop" if loop and not case.is_limit else ""
            print(f"  {case.name}: {seconds:.3f} s{rate}{ratio}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
