"""The bundled examples' data (mpdiag/examples/datasets/) is scikit-learn's, value for value: the examples train on
the same images and text as when they read them from scikit-learn, without importing it."""

import subprocess
import sys
from importlib import resources

import numpy as np
import torch
from conftest import ROOT
from sklearn.datasets import load_digits

from mpdiag.examples.data import digits, sklearn_docs_text


def test_digits_equal_scikit_learns():
    reference = load_digits()
    x_train, y_train, x_test, y_test = digits(torch.device("cpu"))
    images = torch.cat([x_train, x_test]).numpy()
    assert images.shape == reference.images.shape == (1797, 8, 8)
    assert np.array_equal(images, (torch.tensor(reference.images, dtype=torch.float32) / 16.0).numpy())
    assert torch.cat([y_train, y_test]).tolist() == reference.target.tolist()
    assert len(x_test) == len(y_test) == 297  # the held-out split is the last 297 images, as before


def test_docs_text_equals_scikit_learns_descriptions():
    folder = resources.files("sklearn.datasets") / "descr"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".rst"))
    assert len(names) >= 10
    assert sklearn_docs_text() == "\n".join((folder / n).read_text(encoding="utf-8") for n in names)


def test_reading_the_data_imports_no_scikit_learn():
    code = ("import sys, torch; from mpdiag.examples.data import digits, sklearn_docs_text; "
            "digits(torch.device('cpu')); sklearn_docs_text(); "
            "print(sorted(m for m in ('sklearn', 'scipy', 'pandas') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
