"""The tabular examples' data (examples/xgboost, examples/lightgbm): a data
set that scikit-learn's wheel ships, read without importing scikit-learn
(under TCG that import, scipy and all, takes minutes), and each rank's shard
of it.

The scripts import it as ``sklearn_data`` (they put this folder on sys.path).
"""

from __future__ import annotations

import gzip
import importlib.machinery
from pathlib import Path

import numpy as np

NAMES = ("digits", "breast_cancer")


def load(name: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Features, labels and the number of classes of `name` (what
    sklearn.datasets.load_digits and load_breast_cancer read)."""
    # PathFinder looks on sys.path, past a module hidden in sys.modules.
    spec = importlib.machinery.PathFinder.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scikit-learn is not installed: its wheel ships the data set")
    data = Path(spec.submodule_search_locations[0]) / "datasets" / "data"
    if name == "digits":
        with gzip.open(data / "digits.csv.gz", "rt") as f:
            rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    else:
        # The first line holds the shape and the class names.
        rows = np.loadtxt(data / "breast_cancer.csv", delimiter=",", skiprows=1, dtype=np.float32)
    x, y = rows[:, :-1], rows[:, -1]
    return x, y, len(np.unique(y))


def split(rows: int, seed: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The test rows (a fifth, the same on every rank), this rank's training
    rows (rank, rank + world, ... of the rest) and the number of training rows."""
    order = np.random.default_rng(seed).permutation(rows)
    n_test = rows // 5
    test, train = order[:n_test], order[n_test:]
    return test, train[rank::world], len(train)
