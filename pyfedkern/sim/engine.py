"""The simulation engine: one process simulates every client of an FL experiment, round by round.

:class:`~pyfedkern.sim.config.ExperimentConfig` says what to run; :class:`Simulation` builds the data, partition
and model, implements the :class:`~pyfedkern.algorithms.FLContext` the algorithms talk to, and
:meth:`Simulation.run` drives the rounds, evaluates, and streams config, per-round metrics, checkpoints and a
summary to disk. Its parts live in modules of their own: the minibatches in :mod:`~pyfedkern.sim.planning`, the
evaluation in :mod:`~pyfedkern.sim.evaluation`, checkpoints and resuming in :mod:`~pyfedkern.sim.checkpoints`, the
choice of the training path and image layout in :mod:`~pyfedkern.algorithms.paths`, and what happens around the
rounds (writing, progress, timing) in the :mod:`~pyfedkern.sim.callbacks`.

Determinism: every random choice comes from a stream keyed by (seed, purpose, round, client, ...), so the same
config gives bitwise the same metrics (on the same machine and thread count), and a run resumed from a checkpoint
continues exactly as an uninterrupted one would. The model's own randomness (dropout) draws from torch's default
generator, which the engine seeds from such a stream when a client's local training starts (a batched group's: from
its round, first client and size).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyfedkern import models
from pyfedkern.algorithms import Algorithm, LocalModel, make_algorithm
from pyfedkern.algorithms.attacks import parse_attack
from pyfedkern.algorithms.base import check_robust
from pyfedkern.algorithms.batched import can_batch, free_memory
from pyfedkern.algorithms.context import FLContext, Team
from pyfedkern.algorithms.paths import choose_layout, choose_path, is_image_batch
from pyfedkern.algorithms.robust import parse_aggregator
from pyfedkern.dpsgd import DPSGD
from pyfedkern.privacy import CentralDP, LocalDP
from pyfedkern.sim.callbacks import Callback, Run, builtin_callbacks, check_callbacks
from pyfedkern.sim.checkpoints import (  # check_resumable, check_workers_match, load_config: re-exported
    check_resumable,  # noqa: F401
    check_reusable,
    check_workers_match,  # noqa: F401
    load_config,  # noqa: F401
    restore_newest,
)
from pyfedkern.sim.config import (
    ExperimentConfig,
    check_data_memory,
    check_device,
    check_local_work,
    check_model_memory,
    check_threads,
    local_world_size,
    parse_lr_schedule,
)
from pyfedkern.sim.evaluation import Evaluator, evaluation_sets
from pyfedkern.sim.parts import Parts, build_module, check_model, fingerprint, parts_from_config
from pyfedkern.sim.planning import BatchPlanner, RoundBatches
from pyfedkern.sim.results import (
    RunWriter,
    check_fingerprint,
    check_frozen,
    is_finished,
    read_config,
    read_metrics,
    write_fingerprint,
    write_frozen,
)

# Purposes of the random streams (first key after the seed); 2, 3, 4: sim.planning's, 5: sim.parts'.
_SAMPLE, _EVAL_SUBSET, _MODEL = 1, 6, 7
logger = logging.getLogger("pyfedkern")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Simulation(FLContext):
    """Builds an experiment from its config and runs it; the :class:`~pyfedkern.algorithms.FLContext` its algorithm
    reads."""

    def __init__(
        self, config: ExperimentConfig, algorithm: Algorithm | None = None, parts: Parts | None = None
    ) -> None:
        """Without ``parts``, the model and data the config names (:func:`~pyfedkern.sim.parts.parts_from_config`);
        with them (the user's own, :class:`~pyfedkern.sim.experiment.Experiment`), the config's run settings."""
        if parts is None:
            config.validate()
        else:
            config.validate_settings()
        check_device(config.device)
        check_threads(config.threads)
        if parts is None:
            check_data_memory(config, free_memory(torch.device("cpu")))  # before the data is made
        self.config = config
        self.seed = config.seed
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.batch_size = config.batch_size
        self.local_epochs = config.local_epochs
        self.local_steps = config.local_steps
        self.momentum = config.momentum
        self.weight_decay = config.weight_decay
        self._lr_schedule = parse_lr_schedule(config.lr_schedule)
        self.algorithm = algorithm or make_algorithm(config.algorithm, **config.algorithm_params)
        #: The server's rule and the Byzantine clients (FLContext.aggregator and .attack, read by Algorithm.round).
        self.aggregator, self.attack = parse_aggregator(config.aggregator), parse_attack(config.attack)
        check_robust(type(self.algorithm), self.aggregator, self.attack)
        if parts is None:
            parts = parts_from_config(config, int(getattr(self.algorithm, "public_per_class", 0)))
        self.parts = parts
        self.data = data = parts.data
        self.partition = parts.partition
        self.num_clients = self.partition.num_clients
        #: Central DP of the server's aggregate (FLContext.central_dp, read by Algorithm.round), or None.
        self.central_dp = central_dp(config, self.num_clients)
        self.client_indices = self.partition.client_indices
        self.client_sizes = np.array([len(ix) for ix in self.client_indices], dtype=np.int64)
        check_local_work(config, self.client_sizes, free_memory(torch.device("cpu")))  # plans are made on the host
        #: The accounting of local DP-SGD (``config.dp == "local"``), or None.
        self.local_dp = local_dp(config, self.client_sizes, self.planned_steps(np.arange(self.num_clients)))
        #: Local DP-SGD of every local step (FLContext.dpsgd, read by local_sgd and BatchedLocal), or None; with
        #: Poisson-sampled batches every sum is divided by the client's expected batch min(B, |D_i|).
        self.dpsgd = None
        poisson = config.dp_sampling == "poisson"
        if self.local_dp is not None:
            expected = functools.partial(_expected_batch, np.minimum(self.batch_size, self.client_sizes))
            sigma = self.local_dp.noise_multiplier
            self.dpsgd = DPSGD(self.local_dp.clip, sigma, config.seed, expected if poisson else None)

        x_train, y_train = self._tensor(data.x_train), self._tensor(data.y_train)
        self.noise_std = self.partition.noise_std
        # every client's samples, client after client; client_x/client_y are views of these (stacked_batches
        # gathers the batches of many clients from them at once)
        stacked = torch.as_tensor(np.concatenate(self.client_indices).astype(np.int64), device=self.device)
        #: The minibatches of every client (FLContext.batches, .stacked_batches and the plans delegate to it).
        self.planner = BatchPlanner(
            x_train[stacked],
            y_train[stacked],
            self.client_sizes,
            seed=self.seed,
            batch_size=self.batch_size,
            local_epochs=self.local_epochs,
            fixed_order=config.batch_order == "fixed",
            noise_std=self.noise_std,
            poisson=poisson,
        )
        self.client_x, self.client_y = self.planner.client_x, self.planner.client_y
        self.public_x, self.public_y = x_train[parts.public], y_train[parts.public]
        x_test, y_test = self._tensor(data.x_test), self._tensor(data.y_test)
        eval_rng = functools.partial(self.rng, _EVAL_SUBSET)
        eval_sets = evaluation_sets(
            x_test, y_test, x_train, y_train, config.eval_test_max, config.eval_train_max, eval_rng
        )
        #: Clients that exist now (a session schedule may change it); sample_clients draws from these.
        self.active_clients = np.arange(self.num_clients, dtype=np.int64)
        #: When set, evaluation uses only test samples with these labels (the classes current clients hold).
        self.eval_labels: np.ndarray | None = None

        spec = parts.model
        if models.builtin_name(spec):  # a built-in model's size is checked before it is built (a user's is not)
            shape, classes = tuple(data.input_shape), data.num_classes
            check_model_memory(
                config, lambda: spec.factory(input_shape=shape, num_classes=classes), free_memory(self.device)
            )
        torch.manual_seed(config.seed)
        module = build_module(spec, data).to(device=self.device, dtype=self.dtype)
        has_accuracy = spec.has_accuracy and data.num_classes is not None
        self.local = LocalModel(
            module, loss=spec.loss, penalty=spec.penalty, predict=spec.predict, has_accuracy=has_accuracy
        )
        check_model(self.local, spec.name, self.planner.x[:2], self.planner.y[:2], data.num_classes)
        if self.dpsgd is not None:  # an algorithm or a layer it cannot privatise (BatchNorm training): refused now
            type(self.algorithm).check_local_dp()
            with torch.random.fork_rng(devices=[]):  # one private step's clipped sum on two samples
                self.dpsgd.clipped_sum(module.train(), self.local.loss, self.planner.x[:2], self.planner.y[:2])
        #: Evaluates global models (:meth:`evaluate` delegates to it).
        self.evaluator = Evaluator(self.local, *eval_sets, parts.evaluate)
        self.initial_vector = self.local.flat.data.detach().clone()
        #: Digests of the model's structure, the data and the split, kept in the run directory (checked on resume).
        self.fingerprint = fingerprint(parts, module)
        #: The model's frozen parameters {name: tensor}: not federated, kept once in the run directory (frozen.pt).
        self.frozen = {name: p for name, p in module.named_parameters() if not p.requires_grad}
        #: Batched training of each round's participants (FLContext.batched), in chunks of client_chunk; None until
        #: the engine's choice is made (see the ``batched`` property).
        self._batched = config.batched
        #: Channels-last image batches in the per-client loop; None until the engine's choice is made.
        self._channels_last = config.channels_last
        self.client_chunk = config.client_chunk
        #: One training sample (the memory estimate of batched training measures the model's activations on it).
        self.sample_input = self.planner.x[0]
        if config.batched and not can_batch(self.local):
            logger.warning(
                "model %r has persistent buffers (e.g. BatchNorm statistics): its clients train one after another, "
                "not batched",
                spec.name,
            )
        #: Seconds spent in each :meth:`timer` category this round (the Timing callback starts it afresh).
        self.times: dict[str, float] = {}
        #: The ranks this run is spread over (FLContext.team): one process unless pyfedkern.sim.distributed sets it.
        self.team = Team()
        #: Processes of this run sharing the device's memory (``FLContext.device_sharers``), the local ranks on a CPU.
        self.device_sharers = local_world_size() if self.device.type == "cpu" else 1

    # FLContext -------------------------------------------------------------------------------------------

    @property
    def batched(self) -> bool:
        """Whether a round's participants train batched: ``config.batched``, or when that is None the faster path
        for this model, device and chunk size (:func:`~pyfedkern.algorithms.paths.choose_path`), chosen at the
        first read (under the run's thread count) and logged."""
        if self._batched is None:
            rows = max(1, round(self.config.fraction * self.num_clients))
            choice = choose_path(self, min(rows, self.client_chunk or rows))
            self._batched = choice.batched
            measured = "" if choice.seconds is None else f" (seconds: {choice.seconds})"
            path = "batched steps" if choice.batched else "a loop over clients"
            logger.info("model %s: clients train as %s: %s%s", self.config.model, path, choice.reason, measured)
        return self._batched

    @batched.setter
    def batched(self, value: bool) -> None:
        self._batched = value

    @property
    def rounds(self) -> int:
        """The run's number of rounds (``config.rounds``)."""
        return self.config.rounds

    @property
    def channels_last(self) -> bool:
        """Whether the per-client loop feeds image batches channels-last: ``config.channels_last``, or when that is
        None the faster layout for this model (:func:`~pyfedkern.algorithms.paths.choose_layout`; never on the
        batched path), chosen at the first read and logged."""
        if self._channels_last is None:
            self._channels_last = False
            if not self.batched:
                rows = max(1, round(self.config.fraction * self.num_clients))
                choice = choose_layout(self, min(rows, self.client_chunk or rows))
                self._channels_last = choice.channels_last
                if choice.seconds is not None:
                    layout = "channels-last" if choice.channels_last else "contiguous"
                    logger.info(
                        "model %s: the loop feeds %s image batches: %s (seconds: %s)",
                        self.config.model,
                        layout,
                        choice.reason,
                        choice.seconds,
                    )
        return self._channels_last

    @channels_last.setter
    def channels_last(self, value: bool) -> None:
        self._channels_last = value

    def lr(self, t: int) -> float:
        """The local learning rate of round t under the config's schedule."""
        name, value = self._lr_schedule
        if name == "exp":
            return self.config.lr * value**t
        if name == "invsqrt":
            return self.config.lr / math.sqrt(t / value + 1.0)
        return self.config.lr

    def rng(self, *keys: int) -> np.random.Generator:
        """A generator seeded by (seed, ``*keys``): one independent, reproducible stream per purpose and round."""
        return np.random.default_rng([self.seed, *(int(k) for k in keys)])

    @contextlib.contextmanager
    def timer(self, category: str) -> Iterator[None]:
        """Context manager adding the block's wall time to the round's time of ``category``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[category] = self.times.get(category, 0.0) + time.perf_counter() - start

    def sample_clients(self, t: int) -> np.ndarray:
        """Round t's participants: max(1, round(fraction·m)) active clients drawn without replacement, sorted."""
        pool = self.active_clients
        k = max(1, round(self.config.fraction * len(pool)))
        if self.config.sample_with_replacement:
            return np.sort(self.rng(_SAMPLE, t).choice(pool, size=k, replace=True))
        if k >= len(pool):
            return pool.copy()
        return np.sort(self.rng(_SAMPLE, t).choice(pool, size=k, replace=False))

    def batch_indices(
        self,
        cid: int,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> list[np.ndarray]:
        """Positions in client cid's data of the minibatches :meth:`batches` yields in round t, one int64 array per
        step.

        The number of steps is ``steps`` if given, else ⌈E·n/B⌉ (⌊E·n/B⌋ with drop_last); epoch e of round t uses
        the permutation of the seeded stream (t, cid, e) ("reshuffle") or one fixed permutation per client ("fixed").
        With ``dp_sampling="poisson"`` each step's batch is instead a Poisson sample of the client's data at rate
        min(B, n)/n (:mod:`~pyfedkern.sim.planning`), possibly empty.
        """
        return self.batch_plans(
            [cid], t, epochs=epochs, steps=steps, order=order, drop_last=drop_last, batch_size=batch_size
        )[0]

    def batch_plans(
        self,
        clients: Any,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> list[list[np.ndarray]]:
        """:meth:`batch_indices` of every client in ``clients`` (:meth:`BatchPlanner.plans
        <pyfedkern.sim.planning.BatchPlanner.plans>`)."""
        return self.planner.plans(clients, t, epochs, steps, order, drop_last, batch_size)

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
        """Minibatches of client cid in round t (those of :meth:`batch_indices`); see
        :class:`~pyfedkern.algorithms.FLContext`. Feature-skew partitions add the client's Gaussian noise to every
        batch, drawn afresh each round.
        """
        plan = self.batch_indices(
            cid, t, epochs=epochs, steps=steps, order=order, drop_last=drop_last, batch_size=batch_size
        )
        image = is_image_batch(self.client_x[cid])
        layout = torch.channels_last if self.channels_last and image else torch.contiguous_format
        self.seed_model_randomness(t, cid)  # after the layout, which may be measured now
        yield from self.planner.client_batches(cid, t, plan, layout)

    def stacked_batches(
        self,
        clients: Any,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> RoundBatches:
        """The minibatches of many clients in round t, gathered a step at a time
        (:class:`~pyfedkern.algorithms.context.StackedBatches`): the clients ordered by descending number of steps,
        and at step s the batches of those that still have one, client r's equal to what
        ``batches(clients[r], t, ...)`` yields at step s (noise included). The whole round's sample index is built on
        the host without a loop over clients and copied to the device once."""
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        counts = self.planner.counts(clients, epochs, steps, drop_last, batch_size)[2]
        ordered = clients[np.argsort(-counts, kind="stable")]
        if len(ordered):
            self.seed_model_randomness(t, int(ordered[0]), len(ordered))
        plan = self.planner.plan(ordered, t, epochs, steps, order, drop_last, batch_size)
        return RoundBatches(self.planner, plan, t)

    def seed_model_randomness(self, t: int, *keys: int) -> None:
        """Seed torch's default generators, which the model's own randomness (dropout) draws from, from the stream
        (seed, model, round t, ``*keys``). The engine does it when a client's local training of round t starts (its
        minibatches are asked for; batched: a group's); FNR-FL when its server refines a client. A client then draws
        the same numbers whichever process trains it and whatever ran before it: distributed rounds (per-client
        loop) and resumed runs train as one uninterrupted process does."""
        seed = int(self.rng(_MODEL, t, *keys).integers(2**62))
        torch.default_generator.manual_seed(seed)  # not torch.manual_seed: that seeds every backend (0.2 ms a call)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A data array on the device, floating-point data in the run's dtype."""
        tensor = torch.as_tensor(array, device=self.device)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    # Evaluation and the run loop -------------------------------------------------------------------------

    def evaluate(self, vector: torch.Tensor) -> dict[str, float]:
        """Test loss/accuracy (restricted to ``eval_labels`` when set), the user's own test metrics (``test_<name>``)
        and, unless ``eval_train_max`` is 0, train loss/accuracy of a global model (:class:`Evaluator
        <pyfedkern.sim.evaluation.Evaluator>`)."""
        return self.evaluator.evaluate(vector, self.team, self.eval_labels)

    def run(
        self,
        out_dir: str | Path | None = None,
        *,
        resume: bool = False,
        progress: bool = False,
        callbacks: list[Callback] | tuple[Callback, ...] = (),
    ) -> list[dict[str, Any]]:
        """Run (or resume) the experiment; return the per-round metrics (round 0 = the initial model).

        With ``out_dir``, config.json, metrics.jsonl (one line per round, written as it goes), checkpoints every
        ``checkpoint_every`` rounds and after the last, summary.json and model.pt are written there, by this process
        alone (:class:`~pyfedkern.sim.results.RunWriter` holds the directory's lock). ``resume`` continues the run
        in ``out_dir``, or extends a finished one when ``config.rounds`` is above its rounds. Spread over processes
        when ``self.team`` is a process group's (:func:`pyfedkern.sim.distributed.run_distributed`): then rank 0
        writes. The engine's own :mod:`~pyfedkern.sim.callbacks` do the writing, the progress bar, the timing and
        the divergence warning; ``callbacks`` (:class:`~pyfedkern.sim.callbacks.Callback` instances, e.g. the
        loggers of :mod:`pyfedkern.sim.loggers`) are called after them.
        """
        callbacks = check_callbacks(callbacks)
        if self.team.size == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"this process is one of {os.environ['WORLD_SIZE']} started by torchrun: run the experiment with "
                "pyfedkern.sim.distributed.run_distributed (or `pyfedkern run`), so that the processes share the "
                "rounds and only rank 0 writes"
            )
        writing = None  # only rank 0 writes; a refusal there is raised on every rank
        if out_dir is not None:
            writing = self.team.first(lambda: RunWriter(out_dir, self.config.to_dict(), resume=resume))
        threads = self.config.threads or self.auto_threads()
        with _cpu_threads(threads), writing or contextlib.nullcontext() as writer:  # the lock held to the end
            return self._run(out_dir, writer, resume, [*builtin_callbacks(progress), *callbacks])

    def auto_threads(self) -> int:
        """CPU threads when ``config.threads`` is None: :func:`threads_for_work` of one batched training step (this
        rank's share of a round's participants, at most a chunk of them, times the batch size times the number of
        parameters), on this process's share of the cores."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        cores = max(1, cores // local_world_size())
        rows = max(1, round(self.config.fraction * self.num_clients)) / self.team.size
        if not self.batched:
            rows = 1
        elif self.client_chunk is not None:
            rows = min(rows, self.client_chunk)
        return threads_for_work(rows * self.batch_size * self.local.dim, cores)

    def _run(
        self, out_dir: str | Path | None, writer: RunWriter | None, resume: bool, callbacks: list[Callback]
    ) -> list[dict[str, Any]]:
        """The rounds, calling ``callbacks``; ``writer`` (rank 0's; None on the other ranks) writes ``out_dir``."""
        cfg, algo = self.config, self.algorithm
        algo.setup(self, self.initial_vector)
        metrics: list[dict[str, Any]] = []
        start = 0
        if out_dir is not None and resume:
            start, metrics = restore_newest(self, writer)
        elif writer is not None:
            write_fingerprint(writer.dir, self.fingerprint)
            write_frozen(writer.dir, self.frozen)
        run = Run(self, None if out_dir is None else Path(out_dir), writer, start, metrics)
        for callback in callbacks:
            callback.on_run_start(run)
        if start == 0:  # a new run, or one interrupted before its first checkpoint
            evaluation = self._timed_evaluation(algo.global_model()) if cfg.eval_initial else {}
            _round_end(run, callbacks, {"round": 0, **evaluation})
        for t in range(start, cfg.rounds):
            for callback in callbacks:
                callback.on_round_start(run, t)
            stats = algo.round(t, self)
            record: dict[str, Any] = {
                "round": t + 1,
                "local_loss": stats.local_loss,
                "clients": len(stats.clients),
                "bytes_up": 4 * stats.upload_floats,
                "bytes_down": 4 * stats.download_floats,
                "lr": self.lr(t),
            }
            if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.rounds:
                with self.timer("evaluation"):
                    record.update(self.evaluate(algo.global_model()))
            record.update(stats.extras)
            if self.local_dp is not None:
                record["dp_epsilon"] = self.local_dp.epsilon(t + 1)
            _round_end(run, callbacks, record)
        for callback in callbacks:
            callback.on_run_end(run)
        return metrics

    def _timed_evaluation(self, vector: torch.Tensor) -> dict[str, float]:
        start = time.perf_counter()
        result = self.evaluate(vector)
        result["time_evaluation"] = time.perf_counter() - start
        return result


#: Multiply-adds of a training step that keep one more CPU thread busy (a few milliseconds of work per thread).
WORK_PER_THREAD = 1 << 22


def central_dp(config: ExperimentConfig, num_clients: int) -> CentralDP | None:
    """The :class:`~pyfedkern.privacy.CentralDP` of a config with ``dp="central"`` (σ solved from dp_epsilon over
    the config's rounds when given), or None. The cohort is the engine's round(fraction·clients)."""
    if config.dp != "central":
        return None
    settings = {
        "clip": config.dp_clip,
        "delta": config.dp_delta,
        "population": config.dp_population or num_clients,
        "cohort": max(1, round(config.fraction * num_clients)),
        "rounds": config.rounds,
        "noise_cohort": config.dp_noise_cohort,
        "target_quantile": config.dp_adaptive_clip,
        "accountant": config.dp_accountant,
    }
    if config.dp_epsilon is not None:
        return CentralDP.for_epsilon(config.dp_epsilon, **settings)
    return CentralDP(noise_multiplier=config.dp_noise_multiplier, **settings)


def _expected_batch(expected: np.ndarray, key: Any) -> float:
    """The expected Poisson batch ``expected[i]`` of client i's DP-SGD step of noise key (round, i, step)."""
    return float(expected[key[1]])


def local_dp(config: ExperimentConfig, client_sizes: np.ndarray, steps: np.ndarray) -> LocalDP | None:
    """The :class:`~pyfedkern.privacy.LocalDP` accounting of a config with ``dp="local"`` (σ solved from dp_epsilon
    over the config's rounds when given), or None. Clients of ``client_sizes`` samples taking ``steps`` local steps
    a round (batches of min(B, n), fixed-size or expected with dp_sampling="poisson"): accounted for the largest
    rate min(B, n)/n and the most steps."""
    if config.dp != "local":
        return None
    sizes = np.asarray(client_sizes, dtype=np.int64)
    settings = {
        "clip": config.dp_clip,
        "delta": config.dp_delta,
        "records": int(sizes.max()),
        "sampling_rate": float(np.max(np.minimum(config.batch_size, sizes) / sizes)),
        "steps_per_round": max(1, int(np.max(steps))),
        "rounds": config.rounds,
        "accountant": config.dp_accountant,
    }
    if config.dp_epsilon is not None:
        return LocalDP.for_epsilon(config.dp_epsilon, **settings)
    return LocalDP(noise_multiplier=config.dp_noise_multiplier, **settings)


def threads_for_work(work: float, cores: int) -> int:
    """CPU threads for a training step of ``work`` multiply-adds (batched rows × batch size × parameters): one
    per :data:`WORK_PER_THREAD`, at least 1, at most ``cores``."""
    return int(max(1, min(cores, work // WORK_PER_THREAD)))


@contextlib.contextmanager
def _cpu_threads(n: int) -> Iterator[None]:
    """Use n CPU threads in torch and pyfedkern inside the block, then restore the previous counts."""
    import pyfedkern

    before = torch.get_num_threads(), pyfedkern.get_num_threads()
    torch.set_num_threads(n)
    pyfedkern.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        pyfedkern.set_num_threads(before[1])


def _round_end(run: Run, callbacks: list[Callback], record: dict[str, Any]) -> None:
    """Add a new record to the run's metrics and give it to every callback."""
    run.metrics.append(record)
    for callback in callbacks:
        callback.on_round_end(run, record)


def run_experiment(
    config: ExperimentConfig,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> list[dict[str, Any]]:
    """Build and run one experiment (see :meth:`Simulation.run`). With ``resume``, the config stored in
    ``out_dir`` must equal ``config``."""
    return Simulation(config).run(out_dir, resume=resume, progress=progress, callbacks=callbacks)


def run_or_reuse(
    config: ExperimentConfig,
    run_dir: str | Path,
    *,
    progress: bool = False,
    callbacks: list[Callback] | tuple[Callback, ...] = (),
) -> list[dict[str, Any]]:
    """The per-round metrics of ``config`` run in ``run_dir``: read back if that run finished (extended when
    ``config`` has more rounds), resumed if it was interrupted, run otherwise (calling ``callbacks``); a run of
    another config, or of the same config on other data or another model (its fingerprint), raises ValueError
    (never silently reused)."""
    check_reusable(config, run_dir)
    if is_finished(run_dir) and read_config(run_dir)["rounds"] == config.rounds:
        sim = Simulation(config)
        check_fingerprint(run_dir, sim.fingerprint, "reuse")  # the same config may load other data
        check_frozen(run_dir, sim.frozen, "reuse")
        return read_metrics(run_dir)
    resume = (Path(run_dir) / "config.json").exists()  # a run there, of this config (checked), maybe not begun
    return Simulation(config).run(run_dir, resume=resume, progress=progress, callbacks=callbacks)
