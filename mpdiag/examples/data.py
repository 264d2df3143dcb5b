"""Real datasets shipped inside mpdiag (``mpdiag/examples/datasets/``), so examples train offline and deterministically.

* ``digits``: the 1,797 handwritten 8x8 digit images (UCI optical recognition set), 10 classes, as scikit-learn
  1.9.1's ``load_digits`` gives them.
* ``sklearn_docs_text``: the reStructuredText descriptions of scikit-learn 1.9.1's datasets (English prose, about
  43 kB), for a character-level language model.

Both are copies of scikit-learn's files (datasets/README.md says where from, under which licence, and how they were
made), read with numpy and gzip: importing scikit-learn (and the SciPy and pandas it brings) cost every process that
trained an example ~1.6 CPU-seconds, a sandboxed child included. tests/training/test_example_data.py checks that they
equal scikit-learn's own, byte for byte.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from importlib import resources

import numpy as np
import torch

_DATASETS = resources.files("mpdiag.examples") / "datasets"


def digits(device: torch.device, holdout: int = 297) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1], shape (N, 8, 8); labels int64.
    The split is fixed (the last ``holdout`` images are held out)."""
    with (_DATASETS / "digits.npz").open("rb") as file, np.load(file) as data:
        x = torch.tensor(data["images"], dtype=torch.float32) / 16.0  # pixel values 0..16
        y = torch.tensor(data["target"], dtype=torch.int64)
    return x[:-holdout].to(device), y[:-holdout].to(device), x[-holdout:].to(device), y[-holdout:].to(device)


def sklearn_docs_text() -> str:
    """The concatenated dataset descriptions shipped with scikit-learn, in a fixed (sorted by file name) order."""
    with (_DATASETS / "sklearn_dataset_docs.txt.gz").open("rb") as file:
        return gzip.decompress(file.read()).decode("utf-8")


def shuffled_batches(n: int, batch_size: int, device: torch.device) -> Callable[[int], torch.Tensor]:
    """``step -> index tensor`` over ``n`` examples, reshuffled every epoch from a generator seeded once
    (from torch's global RNG, which the runner seeds), so batches do not depend on the opt level."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    per_epoch = n // batch_size
    orders: dict[int, torch.Tensor] = {}

    def indices(step: int) -> torch.Tensor:
        epoch, k = divmod(step, per_epoch)
        if epoch not in orders:
            orders.clear()
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        return orders[epoch][k * batch_size : (k + 1) * batch_size].to(device)

    return indices


def labelled_batches(inputs: torch.Tensor, labels: torch.Tensor, batch_size: int, device: torch.device):
    """``step -> (inputs, labels)`` minibatches from :func:`shuffled_batches` (a model script's 'batches')."""
    indices = shuffled_batches(len(inputs), batch_size, device)

    def batch(step: int):
        idx = indices(step)
        return inputs[idx], labels[idx]

    return batch
