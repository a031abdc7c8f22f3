"""The simulation engine: one process simulates every client of an FL experiment, round by round.

:class:`~pyfedkern.sim.config.ExperimentConfig` says what to run; :class:`Simulation` builds the data, partition
and model, implements the :class:`~pyfedkern.algorithms.FLContext` the algorithms talk to, and
:meth:`Simulation.run` drives the rounds, evaluates, and streams config, per-round metrics, checkpoints and a
summary to disk.

Determinism: every random choice comes from a stream keyed by (seed, purpose, round, client, ...), so the same
config gives bitwise the same metrics (on the same machine and thread count), and a run resumed from a checkpoint
continues exactly as an uninterrupted one would. The model's own randomness (dropout) draws from torch's default
generator, which the engine seeds from such a stream when a client's local training starts (a batched group's: from
its round, first client and size).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyfedkern import models
from pyfedkern.algorithms import Algorithm, LocalModel, make_algorithm
from pyfedkern.algorithms.attacks import parse_attack
from pyfedkern.algorithms.base import check_robust
from pyfedkern.algorithms.batched import can_batch, free_memory
from pyfedkern.algorithms.context import FLContext, Team, padding_weights
from pyfedkern.algorithms.paths import choose_layout, choose_path, is_image_batch
from pyfedkern.algorithms.robust import parse_aggregator
from pyfedkern.dpsgd import DPSGD
from pyfedkern.ops import seeded_permutations
from pyfedkern.privacy import CentralDP, LocalDP
from pyfedkern.sim.callbacks import Callback, Run, builtin_callbacks, check_callbacks
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
from pyfedkern.sim.parts import Parts, build_module, check_model, fingerprint, parts_from_config
from pyfedkern.sim.results import (
    RESUME_FREE_FIELDS,
    ResumePoint,
    RunWriter,
    check_fingerprint,
    check_frozen,
    config_differences,
    is_finished,
    read_config,
    read_metrics,
    write_fingerprint,
    write_frozen,
)

# Purposes of the random streams (first key after the seed).
_SAMPLE, _BATCH, _FIXED_ORDER, _NOISE, _PUBLIC, _EVAL_SUBSET, _MODEL = 1, 2, 3, 4, 5, 6, 7  # _PUBLIC: sim.parts
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
        #: Local DP-SGD of every local step (FLContext.dpsgd, read by local_sgd and BatchedLocal), or None.
        self.dpsgd = (
            None if self.local_dp is None else DPSGD(self.local_dp.clip, self.local_dp.noise_multiplier, config.seed)
        )

        x_train, y_train = self._tensor(data.x_train), self._tensor(data.y_train)
        # every client's samples, client after client; client_x/client_y are views of these (stacked_batches
        # gathers the batches of many clients from them at once)
        stacked = torch.as_tensor(np.concatenate(self.client_indices).astype(np.int64), device=self.device)
        self._all_x, self._all_y = x_train[stacked], y_train[stacked]
        self._client_offsets = np.concatenate([[0], np.cumsum(self.client_sizes)]).astype(np.int64)
        spans = list(zip(self._client_offsets[:-1].tolist(), self._client_offsets[1:].tolist(), strict=True))
        self.client_x = [self._all_x[a:b] for a, b in spans]
        self.client_y = [self._all_y[a:b] for a, b in spans]
        self.public_x, self.public_y = x_train[parts.public], y_train[parts.public]
        self.noise_std = self.partition.noise_std
        self.x_test, self.y_test = self._tensor(data.x_test), self._tensor(data.y_test)
        if config.eval_test_max is not None and len(data.y_test) > config.eval_test_max:
            keep = np.sort(self.rng(_EVAL_SUBSET, 1).choice(len(data.y_test), config.eval_test_max, replace=False))
            self.x_test, self.y_test = self.x_test[keep], self.y_test[keep]
        eval_idx = np.arange(len(data.y_train))
        if eval_idx.size > config.eval_train_max:
            eval_idx = np.sort(self.rng(_EVAL_SUBSET).choice(eval_idx, config.eval_train_max, replace=False))
        self.x_eval_train, self.y_eval_train = x_train[eval_idx], y_train[eval_idx]
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
        check_model(self.local, spec.name, self._all_x[:2], self._all_y[:2], data.num_classes)
        if self.dpsgd is not None:  # an algorithm or a layer it cannot privatise (BatchNorm training): refused now
            type(self.algorithm).check_local_dp()
            with torch.random.fork_rng(devices=[]):  # one private step's clipped sum on two samples
                self.dpsgd.clipped_sum(module.train(), self.local.loss, self._all_x[:2], self._all_y[:2])
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
        self.sample_input = self._all_x[0]
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
        """:meth:`batch_indices` of every client in ``clients`` (see ``_plan``)."""
        plan = self._plan(clients, t, epochs, steps, order, drop_last, batch_size)
        ends = np.cumsum(plan.counts)
        batches = [plan.perms[a : a + n] for a, n in zip(plan.first.tolist(), plan.length.tolist(), strict=True)]
        return [batches[e - n : e] for e, n in zip(ends.tolist(), plan.counts.tolist(), strict=True)]

    def planned_steps(self, clients: np.ndarray) -> np.ndarray:
        """Local steps [k] int64 of ``clients`` in a round under the run's settings (local_steps, else ⌈E·n/B⌉)."""
        return self._step_counts(np.asarray(clients, dtype=np.int64), None, self.local_steps, False, None)[2]

    def _step_counts(
        self, clients: np.ndarray, epochs: float | None, steps: int | None, drop_last: bool, batch_size: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(samples n, batch size min(B, n), local steps) of each client: ``steps``, else ⌈E·n/b⌉ (⌊E·n/b⌋ with
        drop_last)."""
        n = self.client_sizes[clients]
        size = np.minimum(batch_size or self.batch_size, n)
        if steps is None:
            work = (epochs if epochs is not None else self.local_epochs) * n / size
            counts = np.floor(work + 1e-9) if drop_last else np.ceil(work - 1e-9)
        else:
            counts = np.full(len(clients), steps)
        return n, size, np.maximum(counts, 0).astype(np.int64)

    def _plan(
        self,
        clients: Any,
        t: int,
        epochs: float | None,
        steps: int | None,
        order: str,
        drop_last: bool,
        batch_size: int | None,
    ) -> _Plan:
        """Every minibatch of ``clients`` in round t, client after client, without a loop over clients.

        Client c of n samples takes ``steps`` steps, else ⌈E·n/b⌉ (⌊E·n/b⌋ with drop_last) with b = min(B, n); step
        s is batch s mod (batches per epoch) of epoch ⌊s / (batches per epoch)⌋, cut from the epoch's permutation
        of the seeded stream (t, c, e) ("reshuffle") or of the client's one fixed permutation ("fixed"). The
        permutations of all clients come from one native call (:func:`pyfedkern.ops.seeded_permutations`, equal to
        ``self.rng(...).permutation(n)`` of each stream).
        """
        if order not in ("reshuffle", "fixed"):
            raise ValueError(f"order must be 'reshuffle' or 'fixed', got {order!r}")
        if self.config.batch_order == "fixed":  # the run keeps every client's batch order across rounds
            order = "fixed"
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        n, size, counts = self._step_counts(clients, epochs, steps, drop_last, batch_size)
        per_epoch = n // size if drop_last else -(-n // size)  # every client holds data, so per_epoch >= 1
        if order == "fixed":  # the client's one fixed permutation, when it takes a step
            draws = (counts > 0).astype(np.int64)
            keys = np.stack([np.full(len(clients), _FIXED_ORDER), clients], axis=1)[counts > 0]
        else:  # one permutation per epoch begun
            draws = -(-counts // per_epoch)
            owner = np.repeat(np.arange(len(clients)), draws)
            epoch = np.arange(len(owner)) - np.repeat(np.cumsum(draws) - draws, draws)
            keys = np.stack([np.full(len(owner), _BATCH), np.full(len(owner), t), clients[owner], epoch], axis=1)
        perms = seeded_permutations(self.seed, keys, np.repeat(n, draws))
        starts = np.cumsum(draws * n) - draws * n  # where each client's permutations begin in perms
        owner = np.repeat(np.arange(len(clients)), counts)
        step = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        epoch, b = np.divmod(step, per_epoch[owner])
        if order == "fixed":
            epoch[:] = 0  # the fixed permutation again
        first = starts[owner] + epoch * n[owner] + b * size[owner]
        length = np.minimum(size[owner], n[owner] - b * size[owner])
        return _Plan(clients, counts, perms, owner, step, first, length)

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
        x, y = self.client_x[cid], self.client_y[cid]
        plan = self.batch_indices(
            cid, t, epochs=epochs, steps=steps, order=order, drop_last=drop_last, batch_size=batch_size
        )
        layout = torch.channels_last if self.channels_last and is_image_batch(x) else torch.contiguous_format
        self.seed_model_randomness(t, cid)  # after the layout, which may be measured now
        for step, positions in enumerate(plan):
            idx = torch.as_tensor(positions, device=self.device)
            yield self._add_noise(x[idx], cid, t, step).contiguous(memory_format=layout), y[idx]

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
        counts = self._step_counts(clients, epochs, steps, drop_last, batch_size)[2]
        ordered = clients[np.argsort(-counts, kind="stable")]
        if len(ordered):
            self.seed_model_randomness(t, int(ordered[0]), len(ordered))
        kwargs = (epochs, steps, order, drop_last, batch_size)
        return RoundBatches(self, self._plan(ordered, t, *kwargs), t)

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

    def _add_noise(self, xb: torch.Tensor, cid: int, t: int, step: int) -> torch.Tensor:
        """xb plus client cid's Gaussian feature noise of (round t, step) (feature-skew partitions), else xb."""
        sigma = 0.0 if self.noise_std is None else float(self.noise_std[cid])
        if sigma <= 0:
            return xb
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(self.rng(_NOISE, t, cid, step).integers(2**62)))
        return xb + sigma * torch.randn(xb.shape, generator=gen, device=self.device, dtype=xb.dtype)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        """A data array on the device, floating-point data in the run's dtype."""
        tensor = torch.as_tensor(array, device=self.device)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    # Evaluation and the run loop -------------------------------------------------------------------------

    def evaluate(self, vector: torch.Tensor) -> dict[str, float]:
        """Test loss/accuracy (restricted to ``eval_labels`` when set), the user's own test metrics (``test_<name>``)
        and, unless ``eval_train_max`` is 0, train loss/accuracy of a global model."""
        x, y = self.x_test, self.y_test
        if self.eval_labels is not None:
            keep = torch.isin(y, torch.as_tensor(self.eval_labels, device=self.device))
            x, y = x[keep], y[keep]

        def evaluate(xs: torch.Tensor, ys: torch.Tensor) -> tuple[float, float]:
            return self.local.evaluate(vector, xs, ys)

        test_loss, test_acc = self.team.evaluate(evaluate, x, y)
        result = {"test_loss": test_loss, "test_acc": test_acc}
        if self.parts.evaluate is not None:
            result.update(self._user_metrics(x, y, taken=result))
        if self.config.eval_train_max > 0:
            train_loss, train_acc = self.team.evaluate(evaluate, self.x_eval_train, self.y_eval_train)
            result.update(train_loss=train_loss, train_acc=train_acc)
        return result

    @torch.no_grad()
    def _user_metrics(self, x: torch.Tensor, y: torch.Tensor, taken: dict[str, float]) -> dict[str, float]:
        """The user's ``evaluate(model, x, y)`` of the model loaded in ``local`` (eval mode), as ``test_<name>``;
        a name whose ``test_<name>`` is in ``taken`` (the engine's own metrics) is refused."""
        module = self.local.module
        module.eval()
        metrics = self.parts.evaluate(module, x, y)
        if not isinstance(metrics, dict):
            raise TypeError(f"evaluate must return a dict of metric name → number, got {type(metrics).__name__}")
        out = {}
        for name, value in metrics.items():
            if f"test_{name}" in taken:
                raise ValueError(
                    f"evaluate: metric {name!r} would replace the engine's own test_{name}: give it another name"
                )
            try:
                out[f"test_{name}"] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"evaluate: metric {name!r} is {value!r}, not a number") from None
        return out

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
            start, metrics = self._resume(writer)
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

    def _resume(self, writer: RunWriter | None) -> tuple[int, list[dict[str, Any]]]:
        """Restore the newest intact checkpoint of the run (rank 0 reads and checks it, each rank gets its shard);
        (the last round done, the metrics of rounds 0..that round)."""
        team = self.team

        def resume_point():
            point = writer.resume_point()  # everything checked before any file changes
            check_fingerprint(writer.dir, self.fingerprint)
            check_frozen(writer.dir, self.frozen)
            check_workers_match(writer, point, team.size)
            done, cfg = point.round, self.config
            if point.metrics and done < cfg.rounds and done % cfg.eval_every:  # a finished run now extended:
                # its last round was evaluated as the last; a run of cfg.rounds from the start does not evaluate it
                last = point.metrics[-1]
                point.metrics[-1] = {k: v for k, v in last.items() if not k.startswith(("test_", "train_"))}
            return point, writer.start_from(point)

        found = team.first(resume_point)
        shares = None
        if found is not None:  # rank 0
            point, metrics = found
            shards = [None] * team.size if point.state is None else point.state["algorithm"]
            if point.state is not None and team.size == 1:
                shards = [shards]
            shares = [
                (
                    point.round,
                    metrics,
                    point.checkpoint,
                    None if point.state is None else {**point.state, "algorithm": a},
                )
                for a in shards
            ]
        start, metrics, path, state = team.scatter(shares)
        if state is not None:
            self._restore(path, state)
        return start, metrics

    def checkpoint_state(self, rounds_done: int) -> dict[str, Any]:
        """What a checkpoint after ``rounds_done`` rounds holds (this rank's algorithm state among it), with the
        config it was made under (checked on resume); the :class:`~pyfedkern.sim.callbacks.Checkpoints` callback
        saves it."""
        return {
            "round": rounds_done,
            "config": self.config.to_dict(),
            "workers": self.team.size,
            "algorithm": self.algorithm.state_dict(),
            "active_clients": self.active_clients,
            "eval_labels": self.eval_labels,
            "batched": self.batched,
            "channels_last": self.channels_last,
            "buffers": {name: b.detach().cpu().clone() for name, b in self.local.module.named_buffers()},
            "central_dp": None if self.central_dp is None else self.central_dp.state_dict(),
            "local_dp": None if self.local_dp is None else self.local_dp.state_dict(),
        }

    def _restore(self, path: Path, state: dict[str, Any]) -> None:
        """Load the state of checkpoint ``path`` (already checked for integrity and config by the run writer);
        ValueError naming the file when it does not fit this simulation."""

        def labels(value: Any, bound: int) -> bool:
            ints = isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu"
            return ints and (value.size == 0 or (value.min() >= 0 and value.max() < bound))

        active, eval_labels = state.get("active_clients"), state.get("eval_labels")
        if not labels(active, self.num_clients):
            raise ValueError(f"checkpoint {path}: active_clients must be client ids in 0..{self.num_clients - 1}")
        if eval_labels is not None and not labels(eval_labels, self.data.num_classes):
            raise ValueError(
                f"checkpoint {path}: eval_labels must be None or classes in 0..{self.data.num_classes - 1}"
            )
        buffers = dict(self.local.module.named_buffers())
        saved = state.get("buffers", {})
        fits = isinstance(saved, dict) and saved.keys() == buffers.keys()
        if not (fits and all(isinstance(v, torch.Tensor) and v.shape == buffers[k].shape for k, v in saved.items())):
            held = ", ".join(map(str, saved)) if isinstance(saved, dict) and saved else "none"
            raise ValueError(
                f"checkpoint {path}: its model buffers ({held}) do not fit the model's ({', '.join(buffers) or 'none'})"
            )
        try:
            self.algorithm.load_state_dict(state["algorithm"])
        except (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError) as err:
            said = " ".join(str(err).split())  # on one line
            raise ValueError(
                f"checkpoint {path}: its algorithm state does not fit {self.config.algorithm} "
                f"({type(err).__name__}: {said})"
            ) from None
        with torch.no_grad():
            for name, value in saved.items():
                buffers[name].copy_(value)
        if self.central_dp is not None:
            self.central_dp.load_state_dict(state.get("central_dp"), f"checkpoint {path}")
        if self.local_dp is not None:
            self.local_dp.load_state_dict(state.get("local_dp"), f"checkpoint {path}")
        self.active_clients = active.astype(np.int64)
        self.eval_labels = eval_labels
        if self.config.batched is None and isinstance(state.get("batched"), bool):
            self._batched = state["batched"]  # the path the run was taking: a resumed run continues on it
        if self.config.channels_last is None and isinstance(state.get("channels_last"), bool):
            self._channels_last = state["channels_last"]  # and its layout

    def _timed_evaluation(self, vector: torch.Tensor) -> dict[str, float]:
        start = time.perf_counter()
        result = self.evaluate(vector)
        result["time_evaluation"] = time.perf_counter() - start
        return result


@dataclass
class _Plan:
    """Every minibatch of a round's clients, client after client (``Simulation._plan``): ``counts`` [k] steps
    per client; per minibatch, its client's row ``owner``, its ``step``, and its positions in the client's data,
    ``perms[first : first + length]``."""

    clients: np.ndarray
    counts: np.ndarray
    perms: np.ndarray
    owner: np.ndarray
    step: np.ndarray
    first: np.ndarray
    length: np.ndarray


class RoundBatches:
    """What :meth:`Simulation.stacked_batches` returns (see
    :class:`~pyfedkern.algorithms.context.StackedBatches`): the plan's sample index, step after step, on the device.
    Each step's batches are gathered with ``index_select`` into buffers reused from step to step.

    Attributes:
        clients, steps: the clients (descending number of steps) and their steps.
    """

    def __init__(self, sim: Simulation, plan: _Plan, t: int) -> None:
        self.clients, self.steps = plan.clients, plan.counts
        self._sim, self._t = sim, t
        order = np.lexsort((plan.owner, plan.step))  # step after step; each step's clients are a prefix
        owner, first, length = plan.owner[order], plan.first[order], plan.length[order]
        self._rows = np.bincount(plan.step, minlength=int(plan.counts.max(initial=0)))
        self._starts = np.cumsum(self._rows) - self._rows
        if not len(owner):
            return
        self._widths = np.maximum.reduceat(length, self._starts)
        self._ragged = np.minimum.reduceat(length, self._starts) < self._widths
        # step s: its rows × its width, flattened, one after another (padding: any sample of the client, weight 0)
        width = np.repeat(self._widths, self._rows)  # of each row
        self._offsets = np.concatenate([[0], np.cumsum(self._rows * self._widths)])  # where each step begins
        row = np.repeat(np.arange(len(owner)), width)
        col = np.arange(row.size) - np.repeat(np.cumsum(width) - width, width)
        local = plan.perms[np.where(col < length[row], first[row] + col, first[row])]
        index = local + sim._client_offsets[plan.clients[owner[row]]]
        self._index = torch.as_tensor(index, device=sim.device)
        self._length = torch.as_tensor(length, device=sim.device) if self._ragged.any() else None
        self._noisy = sim.noise_std is not None and bool(np.any(np.asarray(sim.noise_std)[plan.clients] > 0))
        self._length_host = length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        sim = self._sim
        if not len(self._rows):
            return
        most = int(np.max(self._rows * self._widths))
        x_buffer = torch.empty(most, *sim._all_x.shape[1:], dtype=sim._all_x.dtype, device=sim.device)
        y_buffer = torch.empty(most, *sim._all_y.shape[1:], dtype=sim._all_y.dtype, device=sim.device)
        for step, (rows, start) in enumerate(zip(self._rows.tolist(), self._starts.tolist(), strict=True)):
            width, (a, b) = int(self._widths[step]), self._offsets[step : step + 2].tolist()
            idx = self._index[a:b]
            xb = torch.index_select(sim._all_x, 0, idx, out=x_buffer[: b - a]).view(rows, width, *x_buffer.shape[1:])
            yb = torch.index_select(sim._all_y, 0, idx, out=y_buffer[: b - a]).view(rows, width, *y_buffer.shape[1:])
            if self._noisy:
                for r in range(rows):
                    n = int(self._length_host[start + r])
                    xb[r, :n] = sim._add_noise(xb[r, :n], int(self.clients[r]), self._t, step)
            wb = None
            if self._ragged[step]:
                wb = padding_weights(self._length[start : start + rows], xb)
            yield xb, yb, wb


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


def local_dp(config: ExperimentConfig, client_sizes: np.ndarray, steps: np.ndarray) -> LocalDP | None:
    """The :class:`~pyfedkern.privacy.LocalDP` accounting of a config with ``dp="local"`` (σ solved from dp_epsilon
    over the config's rounds when given), or None. Clients of ``client_sizes`` samples taking ``steps`` local steps
    a round (fixed-size batches of min(B, n)): accounted for the largest rate min(B, n)/n and the most steps."""
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


def check_resumable(config: ExperimentConfig, run_dir: str | Path, *, workers: int = 1) -> ResumePoint:
    """Raise what ``Simulation(config).run(run_dir, resume=True)`` in ``workers`` processes would raise about the run
    directory (a changed config, a finished run, damaged files, another process writing it, another number of
    workers, ...), without building the simulation or changing any file; return where the run goes on."""
    with RunWriter(run_dir, config.to_dict(), resume=True) as writer:
        point = writer.resume_point()
        check_workers_match(writer, point, workers)
        return point


def check_workers_match(writer: RunWriter, point: Any, workers: int) -> None:
    """ValueError unless the checkpoint of ``point`` (a resume point of ``writer``) was made by ``workers`` processes
    (its shards are theirs: a checkpoint resumes with the number of processes that made it)."""
    made_by = 0 if point.state is None else int(point.state.get("workers", 1))
    if made_by and made_by != workers:
        raise ValueError(
            f"cannot resume {writer.dir}: checkpoint {point.checkpoint.name} was made by {made_by} worker(s) and this "
            f"run has {workers}; resume it with {made_by} (--workers {made_by}, or torchrun with {made_by} processes "
            "in all)"
        )


def check_reusable(config: ExperimentConfig, run_dir: str | Path) -> None:
    """Raise ValueError if ``run_dir`` holds a run (finished or interrupted) of a config other than ``config`` but
    for :data:`~pyfedkern.sim.results.RESUME_FREE_FIELDS`, or a finished run of more rounds."""
    run_dir = Path(run_dir)
    if (run_dir / "config.json").exists():
        changed = [k for k in config_differences(run_dir, config.to_dict()) if k not in RESUME_FREE_FIELDS]
        if changed:
            raise ValueError(
                f"{run_dir} holds a run with a different config (it differs in {', '.join(changed)}); "
                "choose a fresh output directory (--out) or delete that one"
            )
        done = read_config(run_dir)["rounds"]
        if is_finished(run_dir) and done > config.rounds:
            raise ValueError(f"{run_dir} holds a finished run of {done} rounds, more than the {config.rounds} asked")


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


def load_config(out_dir: str | Path) -> ExperimentConfig:
    """The config of a run directory (to resume it), checked; ValueError naming config.json when it is not valid."""
    data = read_config(out_dir)
    try:
        config = ExperimentConfig.from_dict(data)
        config.validate()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{Path(out_dir) / 'config.json'}: {err}") from None
    return config
