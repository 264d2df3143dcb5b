"""Real datasets that ship inside installed packages, so examples train offline and deterministically.

* ``digits``: scikit-learn's 1,797 handwritten 8x8 digit images (UCI optical recognition set), 10 classes.
* ``sklearn_docs_text``: the reStructuredText descriptions of scikit-learn's datasets (English prose,
  about 85 kB), for a character-level language model.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

import torch


def digits(device: torch.device, holdout: int = 297) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): images scaled to [0, 1], shape (N, 8, 8); labels int64.
    The split is fixed (the last ``holdout`` images are held out)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    return x[:-holdout].to(device), y[:-holdout].to(device), x[-holdout:].to(device), y[-holdout:].to(device)


def sklearn_docs_text() -> str:
    """The concatenated dataset descriptions shipped with scikit-learn, in a fixed (sorted) order."""
    folder = resources.files("sklearn.datasets") / "descr"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".rst"))
    return "\n".join((folder / n).read_text(encoding="utf-8") for n in names)


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
