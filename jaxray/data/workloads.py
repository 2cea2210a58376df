"""The arrays each workload trains and evaluates on, in memory or as a prepared Parquet folder."""

from __future__ import annotations

import pyarrow.fs as pafs

from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays, Source, Windows
from jaxray.data.fashion_mnist import load_fashion_mnist
from jaxray.data.manifest import MANIFEST, SPLITS, Manifest, ManifestError, check_fits, read_manifest
from jaxray.data.shakespeare import load_shakespeare
from jaxray.storage import resolve

DEFAULT_SEQ_LEN = 256


def natural_splits(
    dataset: str, data_dir: str | None = None, seq_len: int = DEFAULT_SEQ_LEN
) -> dict[str, Arrays]:
    """{split: arrays} in natural order: TinyShakespeare ``{"tokens": [N, seq_len] int32}`` (train
    and validation, text order), Fashion-MNIST ``{"image": [N, 784] float32, "label": [N] int32}``
    (train and test, file order). Raises DataFileError (files), ValueError (unknown dataset, seq_len)."""
    if dataset == "tinyshakespeare":
        seqs = load_shakespeare(seq_len=seq_len, seed=None, data_dir=data_dir)
        return {"train": {"tokens": seqs.train}, "validation": {"tokens": seqs.validation}}
    if dataset == "fashion-mnist":
        fm = load_fashion_mnist(data_dir)
        return {
            "train": {"image": fm.train_images, "label": fm.train_labels},
            "test": {"image": fm.test_images, "label": fm.test_labels},
        }
    raise ValueError(f"unknown dataset {dataset!r}; expected one of {', '.join(SPLITS)}")


# The dataset each workload trains on (its splits, train and held-out, are ``manifest.SPLITS``).
WORKLOAD_DATASET = {
    "transformer": "tinyshakespeare",
    "mlp": "fashion-mnist",
    "shared_block_mlp": "fashion-mnist",
}


def load_arrays(trial: TrialConfig) -> tuple[Source, Arrays]:
    """(training source, held-out arrays) for ``trial``'s workload (``natural_splits``): the
    transformer's training split as ``Windows`` at every offset, the MLPs' as rows; epochs are
    ordered by ``train_batches``. Raises DataFileError if files are missing or bad."""
    workload = trial.model.workload
    splits = natural_splits(WORKLOAD_DATASET[workload], trial.data.data_dir, trial.data.seq_len)
    return train_source(WORKLOAD_DATASET[workload], splits["train"]), splits[held_out_split(workload)]


def train_source(dataset: str, train: Arrays) -> Source:
    """What training on ``dataset`` draws from its natural-order training split: for text the
    windows at every offset of the text the split's sequences cut (``[N, T]`` rows in text order
    are the first N * T bytes), for the MLPs the rows."""
    if dataset == "tinyshakespeare":
        tokens = train["tokens"]
        return Windows(tokens.reshape(-1), tokens.shape[1])
    return train


def held_out_split(workload: str) -> str:
    """The held-out split's name in a prepared folder: ``validation`` or ``test``."""
    return SPLITS[WORKLOAD_DATASET[workload]][1]


def parquet_folder(trial: TrialConfig, verify_checksums: bool = False) -> tuple[str, Manifest]:
    """(folder, Manifest) of ``trial``'s prepared Parquet data (``data.parquet``/<dataset>). Raises
    ManifestError when missing, damaged, another dataset or another ``data.seq_len``, or when its
    train split decodes to more than ``data.parquet_cache_mib``; with ``verify_checksums``, also when a
    file differs from the SHA-256 its manifest records (changed since ``prepare``)."""
    dataset = WORKLOAD_DATASET[trial.model.workload]
    root = trial.data.parquet.rstrip("/")
    fs, local = resolve(root)
    if fs.get_file_info(local).type == pafs.FileType.NotFound:
        raise ManifestError(f"{root} does not exist")
    if fs.get_file_info(f"{local}/{MANIFEST}").type == pafs.FileType.File:
        raise ManifestError(
            f"{root} is one prepared dataset; data.parquet names the folder that holds "
            f"{' and '.join(sorted(SPLITS))} folders (its parent?)"
        )
    folder = f"{root}/{dataset}"
    manifest = read_manifest(folder, verify_checksums=verify_checksums)
    if manifest.dataset != dataset:
        raise ManifestError(f"{folder} holds {manifest.dataset}, not {dataset}")
    if manifest.seq_len is not None and manifest.seq_len != trial.data.seq_len:
        raise ManifestError(
            f"{folder} holds sequences of {manifest.seq_len} bytes but data.seq_len is "
            f"{trial.data.seq_len}; prepare it with --seq-len {trial.data.seq_len}"
        )
    check_fits(manifest, "train", trial.data.parquet_cache_mib << 20)
    return folder, manifest
