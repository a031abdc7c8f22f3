"""The record every dataset is loaded into (:class:`Dataset`): arrays of a train/test split and what they hold."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Dataset:
    """A train/test split. x: [n, *input_shape] (float32 features, or int64 tokens); y: int64 [n] class labels in
    [0, num_classes), or float regression targets [n, ...] with num_classes None.

    ``normalization`` describes what was applied to x. ``client_ids`` (int64 [n_train]) names the natural client
    of each training sample for datasets that have them (synthetic, synthetic-iid, quadratic, LEAF), else None.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int | None
    input_shape: tuple[int, ...]
    normalization: str
    client_ids: np.ndarray | None = None
