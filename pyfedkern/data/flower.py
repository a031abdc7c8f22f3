"""Partitions made by ``flwr-datasets`` (Flower's federated datasets) as a :class:`~pyfedkern.data.dataset.Dataset`
with natural clients: the optional extra ``pip install pyfedkern[flwr-datasets]``.

pyfedkern downloads nothing: build the ``FederatedDataset`` from local files (``dataset="csv"``/``"parquet"``/
``"imagefolder"`` with ``data_files=`` or ``data_dir=``) or from a Hugging Face dataset already in the local cache
(set ``HF_DATASETS_OFFLINE=1`` so that nothing is fetched).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyfedkern.data.dataset import Dataset


def from_flwr_datasets(
    federated: Any,
    *,
    x: str | Sequence[str],
    y: str,
    train_split: str = "train",
    test_split: str = "test",
    num_classes: int | None = None,
) -> Dataset:
    """The partitions of ``federated`` (a ``flwr_datasets.FederatedDataset`` whose ``train_split`` has a
    partitioner) as training data with one natural client per partition (partition ``natural``), and its
    ``test_split`` as the test set.

    ``x``: the feature column (images, arrays, token lists of one length), or several numeric columns stacked
    into a vector; ``y``: the target column (integer class labels, or float targets). ``num_classes`` defaults to
    the largest label + 1.
    """
    partitioner = getattr(federated, "partitioners", {}).get(train_split)
    if partitioner is None or not hasattr(federated, "load_partition"):
        raise ValueError(
            f"federated must be a flwr_datasets.FederatedDataset with a partitioner for split {train_split!r}"
        )
    columns = [x] if isinstance(x, str) else list(x)
    parts = [federated.load_partition(i, train_split) for i in range(partitioner.num_partitions)]
    test = federated.load_split(test_split)
    x_parts, y_parts = zip(*(_columns(p, columns, y, f"partition {i}") for i, p in enumerate(parts)), strict=True)
    x_test, y_test = _columns(test, columns, y, f"split {test_split!r}")
    x_train, y_train = np.concatenate(x_parts), np.concatenate(y_parts)
    sizes = [len(v) for v in y_parts]
    if y_train.dtype.kind in "iu" and num_classes is None:
        num_classes = int(max(y_train.max(), y_test.max(initial=0))) + 1
    return Dataset(
        f"flwr-datasets:{train_split}",
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes,
        tuple(x_train.shape[1:]),
        "as stored",
        client_ids=np.repeat(np.arange(len(sizes), dtype=np.int64), sizes),
    )


def _columns(table: Any, columns: list[str], target: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) NumPy arrays of a Hugging Face dataset's columns."""
    missing = [c for c in [*columns, target] if c not in table.column_names]
    if missing:
        raise ValueError(f"flwr-datasets {what}: no column(s) {', '.join(missing)}; it has {table.column_names}")
    table = table.with_format("numpy")
    features = [np.asarray(table[c]) for c in columns]
    x = features[0] if len(features) == 1 else np.stack(features, axis=1)
    if x.dtype.kind in "uf":  # image pixels and other numbers; signed integers stay (token ids)
        x = x.astype(np.float32)
    y = np.asarray(table[target])
    return np.ascontiguousarray(x), (y.astype(np.int64) if y.dtype.kind in "iub" else y.astype(np.float32))
