"""Discriminative re-routing: learn which path a prefix should go to from measured losses.

After the paths have trained, each training document's loss under each path is known
(``losses[N, P]``). Label each document with the path of lowest loss and fit a
multinomial logistic regression on the routing features; routing then follows the
classifier (cost = −log p(path | prefix)) instead of k-means distances, as in the DiPaCo
paper's discriminative router.

Fallback (documented): with fewer than ``min_docs`` documents, or when every document
prefers the same path (a single class), no classifier is fitted and the Router keeps
routing by k-means.
"""
from __future__ import annotations

import warnings

import numpy as np

# Cost given to paths the classifier never saw as a label (it cannot assign them
# probability), and the cap on −log p, so costs stay finite and comparable.
UNSEEN_PATH_COST = 30.0


class DiscriminativeHead:
    """A fitted multinomial logistic regression over paths, stored as plain arrays.

    Attributes:
        coef: float32 ``[C, d]`` one row per class (binary problems are stored as two rows).
        intercept: float32 ``[C]``.
        classes: int64 ``[C]`` the path ids the classifier can predict.
        num_paths: P, the number of paths of the grid.
    """

    def __init__(self, coef: np.ndarray, intercept: np.ndarray, classes: np.ndarray, num_paths: int) -> None:
        self.coef = np.asarray(coef, np.float32)
        self.intercept = np.asarray(intercept, np.float32)
        self.classes = np.asarray(classes, np.int64)
        self.num_paths = int(num_paths)
        consistent = self.coef.ndim == 2 and self.coef.shape[0] == self.classes.shape[0]
        if not consistent or self.intercept.shape != self.classes.shape:
            raise ValueError(
                f"inconsistent classifier arrays: coef {self.coef.shape}, intercept "
                f"{self.intercept.shape}, classes {self.classes.shape}"
            )
        if self.classes.size and (self.classes.min() < 0 or self.classes.max() >= self.num_paths):
            raise ValueError(f"classifier classes {self.classes} fall outside [0, {self.num_paths})")

    def costs(self, features: np.ndarray, tie_break: np.ndarray | None = None) -> np.ndarray:
        """−log p(path | features) as float32 ``[N, P]``, lower is better.

        Paths never seen as labels get ``UNSEEN_PATH_COST`` plus ``tie_break`` scaled
        into [0, 1) (the Router passes k-means costs, so top-k beyond the seen paths is
        still ordered by distance).
        """
        z = features.astype(np.float32) @ self.coef.T + self.intercept[None, :]
        z = z - z.max(axis=1, keepdims=True)
        log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        out = np.full((features.shape[0], self.num_paths), UNSEEN_PATH_COST, np.float32)
        if tie_break is not None:
            tb = np.asarray(tie_break, np.float32)
            span = tb.max(axis=1, keepdims=True) - tb.min(axis=1, keepdims=True)
            out += (tb - tb.min(axis=1, keepdims=True)) / np.maximum(span, 1e-12) * 0.999
        out[:, self.classes] = np.minimum(-log_p, UNSEEN_PATH_COST)
        return out

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"coef": self.coef, "intercept": self.intercept, "classes": self.classes}


def fit_discriminative(
    features: np.ndarray,
    losses: np.ndarray,
    *,
    C: float = 1.0,
    max_iter: int = 500,
    min_docs: int = 8,
    seed: int = 0,
    labels: np.ndarray | None = None,
) -> DiscriminativeHead | None:
    """Fit the path classifier; returns None (with a warning) when the fallback applies.

    Args:
        features: float ``[N, d]`` routing features of the documents (Router featurizer).
        losses: float ``[N, P]`` loss of each document under each path (lower is better).
        C: inverse L2 regularisation strength of the logistic regression.
        min_docs: below this many documents, keep k-means routing.
        labels: int ``[N]`` the path each document should learn; None: its lowest-loss
            path. The EM re-shard passes the balanced M-step's paths, so that the
            classifier routes new documents as the capacity-respecting assignment did.
    """
    from sklearn.linear_model import LogisticRegression  # lazy: scikit-learn is slow to import; `import router` stays light

    features = np.asarray(features, np.float32)
    losses = np.asarray(losses, np.float64)
    if features.ndim != 2:
        raise ValueError(f"features must be [N, d], got shape {features.shape}")
    if losses.ndim != 2 or losses.shape[0] != features.shape[0]:
        raise ValueError(
            f"losses must be [N, P] with N = {features.shape[0]} documents, got shape {losses.shape}"
        )
    if not np.isfinite(losses).all():
        raise ValueError("losses contains NaN or inf; drop those documents before fitting")
    n, num_paths = losses.shape
    if labels is None:
        labels = losses.argmin(axis=1)
    labels = np.asarray(labels, np.int64)
    if labels.shape != (n,) or (n and (labels.min() < 0 or labels.max() >= num_paths)):
        raise ValueError(f"labels must be {n} path ids in [0, {num_paths}), got shape {labels.shape}")
    classes = np.unique(labels)
    if n < min_docs:
        warnings.warn(
            f"discriminative re-routing skipped: {n} documents < min_docs={min_docs}; keeping k-means routing",
            stacklevel=2,
        )
        return None
    if classes.size < 2:
        warnings.warn(
            f"discriminative re-routing skipped: every document prefers path {int(classes[0])}; "
            "keeping k-means routing",
            stacklevel=2,
        )
        return None
    clf = LogisticRegression(C=C, max_iter=max_iter, random_state=seed)
    clf.fit(features, labels)
    coef, intercept = clf.coef_, clf.intercept_
    if coef.shape[0] == 1:
        # sklearn stores a binary problem as one row w (p(class 1) = σ(w·x + b)); softmax
        # over the rows [0, w] gives the same probabilities, so keep one row per class.
        coef = np.vstack([np.zeros_like(coef), coef])
        intercept = np.concatenate([[0.0], intercept])
    return DiscriminativeHead(coef, intercept, clf.classes_.astype(np.int64), num_paths)


__all__ = ["DiscriminativeHead", "fit_discriminative", "UNSEEN_PATH_COST"]
