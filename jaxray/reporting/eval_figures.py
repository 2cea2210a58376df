"""The two figures ``python -m jaxray.evaluate`` writes for a Fashion-MNIST classifier:
confusion_matrix.png (row-normalised percentages) and predictions_grid.png (first 25 test images)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # evaluation runs on headless machines: never open a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxray.data.fashion_mnist import IMAGE_SIDE  # noqa: E402
from jaxray.reporting.figures import save_figure  # noqa: E402

GRID_SIDE = 5  # the predictions grid is GRID_SIDE x GRID_SIDE images


def plot_confusion_matrix(matrix: np.ndarray, class_names: Sequence[str], path: Path) -> None:
    """Writes ``matrix`` ([C, C] int counts, rows true, columns predicted) as a heat map of row
    percentages, each cell labelled with its percentage, class names on both axes."""
    percent = 100.0 * matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)  # a row of no examples: 0
    n = len(class_names)
    fig, ax = plt.subplots(figsize=(9, 8))
    image = ax.imshow(percent, cmap="Blues", vmin=0, vmax=100)
    fig.colorbar(image, ax=ax, label="% of the true class")
    for i in range(n):
        for j in range(n):
            color = "white" if percent[i, j] > 50 else "black"  # the dark diagonal stays readable
            ax.text(j, i, f"{percent[i, j]:.1f}", ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(n), class_names, rotation=45, ha="right")
    ax.set_yticks(range(n), class_names)
    ax.set(
        xlabel="predicted class",
        ylabel="true class",
        title=f"Confusion matrix, row-normalised (%), {int(matrix.sum())} test images",
    )
    save_figure(fig, path)


def plot_predictions_grid(
    images: np.ndarray, labels: np.ndarray, predictions: np.ndarray, class_names: Sequence[str], path: Path
) -> None:
    """Writes the first GRID_SIDE**2 of ``images`` ([N, 784] float32 in [0, 1]) in a grid titled
    "pred: X / true: Y", green when ``predictions`` ([N] int) match ``labels`` ([N] int), else red."""
    fig, axes = plt.subplots(GRID_SIDE, GRID_SIDE, figsize=(10, 11))
    for k, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if k >= len(images):  # fewer images than cells: leave the rest blank
            continue
        ax.imshow(images[k].reshape(IMAGE_SIDE, IMAGE_SIDE), cmap="gray_r", vmin=0, vmax=1)
        title = f"pred: {class_names[predictions[k]]} /\ntrue: {class_names[labels[k]]}"
        ax.set_title(title, fontsize=8, color="green" if predictions[k] == labels[k] else "red")
    fig.suptitle(f"First {min(len(images), GRID_SIDE**2)} test images (green: correct, red: wrong)")
    save_figure(fig, path)
