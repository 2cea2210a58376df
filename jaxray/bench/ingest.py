"""``ingest``: one compiled step, params and batches fed, in turn each repeat, ``pre-staged`` (on device),
``in memory`` (``train_batches``), ``ray data, arrays`` (``train_dataset``: the samples drawn in Ray
Data tasks) and ``ray data`` (``parquet_batches``: the split read once through Ray Data):
``warmup`` untimed steps, then ``steps`` timed; median ms/step, input wait and the tokens the feed
makes per second of waiting (text: windows at every offset)."""

from __future__ import annotations

import gc
import itertools
import logging
import shutil
import statistics
import tempfile
import time
from collections import namedtuple

import jax
import ray

from jaxray.bench.report import Report, run_cases
from jaxray.bench.throughput import INIT_SEED, environment, make_spec
from jaxray.data.batching import num_samples, train_batches
from jaxray.data.manifest import read_manifest
from jaxray.data.parquet import parquet_batches
from jaxray.data.prepare import prepare
from jaxray.data.ray_data import shard_batches, train_dataset
from jaxray.data.workloads import natural_splits, train_source
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh, replicate, shard_batch
from jaxray.train.loop import compile_train_step
from jaxray.train.run import tokens_per_example
from jaxray.train.step import init_state, make_optimizer

TARGET = 1.05  # ray data ms/step over pre-staged
DATASET = {"mlp": "fashion-mnist", "transformer": "tinyshakespeare"}
DEFAULTS = {"mlp": (1024, 10, 150), "transformer": (16, 2, 10)}  # global batch, warm-up, timed steps
SEED = 0
STREAMED = ("ray data",)  # the feeds from Parquet
COLUMNS = "workload feed global_batch ms_per_step vs_prestaged input_wait_ms_per_step"
COLUMNS += " feed_tokens_per_sec epoch_boundaries final_loss"
IngestSize = namedtuple("IngestSize", "workload global_batch warmup steps repeats seq_len")


def sizes_for(args) -> list[IngestSize]:
    """The sizes ``ingest``'s options ask for; ValueError where they contradict ``--parquet``'s data."""
    workloads = ["mlp", "transformer"] if args.workload in (None, "all") else [args.workload]
    seq_len = args.seq_len
    if args.parquet is not None:
        manifest = read_manifest(args.parquet)
        workloads = [next(w for w, d in DATASET.items() if d == manifest.dataset)]
        if args.workload not in (None, "all", workloads[0]):
            raise ValueError(f"--parquet {args.parquet} holds {manifest.dataset}: --workload {workloads[0]}")
        if seq_len and manifest.seq_len and seq_len != manifest.seq_len:
            raise ValueError(f"--seq-len {seq_len}: --parquet {args.parquet} holds {manifest.seq_len}")
        seq_len = seq_len or manifest.seq_len
    if args.seq_len is not None and "transformer" not in workloads:
        raise ValueError("--seq-len applies to the transformer only")
    return [IngestSize(w, args.batch or DEFAULTS[w][0],
                       DEFAULTS[w][1] if args.warmup is None else args.warmup, args.steps or DEFAULTS[w][2],
                       args.repeats, seq_len or 256) for w in workloads]  # fmt: skip


class _Run:
    """The compiled step, fresh states and the batches of one size."""

    def __init__(self, size: IngestSize, folder: str, data_dir: str | None, prefetch_batches: int):
        self.size, self.folder, self.prefetch = size, folder, prefetch_batches
        self.trial = make_spec(*size[:2], seq_len=size.seq_len, data_dir=data_dir).trial  # workload, batch
        self.mesh, model = make_mesh(jax.devices()[:1]), build(self.trial.model)
        train = natural_splits(DATASET[size.workload], data_dir, size.seq_len)["train"]
        self.arrays = train_source(DATASET[size.workload], train)
        self.per_epoch = num_samples(self.arrays) // size.global_batch
        host = itertools.islice(train_batches(self.arrays, size.global_batch, SEED), size.warmup + size.steps)
        self.staged = jax.block_until_ready([shard_batch(self.mesh, b) for b in host])
        self.tx = make_optimizer(self.trial.learning_rate, self.trial.train.weight_decay)
        self.params = jax.device_get(model.init(jax.random.key(INIT_SEED[size.workload])))
        self.step, self.compile_s = compile_train_step(
            model, self.tx, self.mesh, self.fresh(), self.staged[0]
        )

    def fresh(self):
        return replicate(init_state(self.params, self.tx), self.mesh)  # the step donates it

    def timed(self, next_batch) -> tuple[float, float, float]:
        """(s per timed step, s per timed step in ``next_batch``, final loss)."""
        state, wait, start = self.fresh(), 0.0, time.perf_counter()
        for i in range(self.size.warmup + self.size.steps):
            if i == self.size.warmup:
                jax.block_until_ready(state)
                start, wait = time.perf_counter(), 0.0
            t = time.perf_counter()
            batch = next_batch(i)
            wait += time.perf_counter() - t
            state, metrics = self.step(state, batch)
        jax.block_until_ready(state)
        return (time.perf_counter() - start) / self.size.steps, wait / self.size.steps, float(metrics["loss"])

    def feed(self, name: str) -> tuple[float, float, float]:
        if name == "pre-staged":
            return self.timed(lambda i: self.staged[i])
        if name == "in memory":
            host = train_batches(self.arrays, self.size.global_batch, SEED)
            return self.timed(lambda i: shard_batch(self.mesh, next(host)))
        if name == "ray data, arrays":
            g = self.size.global_batch
            ds = train_dataset(self.arrays, g, SEED, self.size.warmup + self.size.steps)
            batches = shard_batches(ds.iterator(), g, self.prefetch)
            return self.timed(lambda i: shard_batch(self.mesh, next(batches)))
        stream = parquet_batches(self.folder, "train", self.size.global_batch, SEED)
        try:
            return self.timed(lambda i: shard_batch(self.mesh, next(stream)))
        finally:
            stream.close()


def _rows(run: _Run) -> list[dict]:
    """One row per feed: the medians over repeats, each repeat running every feed in turn."""
    times = {name: [] for name in ["pre-staged", "in memory", "ray data, arrays", *STREAMED]}
    for _ in range(run.size.repeats):
        for name, runs in times.items():
            runs.append(run.feed(name))
    size, lm = run.size, run.size.workload == "transformer"
    boundaries = sum(k % run.per_epoch == 0 for k in range(max(size.warmup, 1), size.warmup + size.steps))
    env = environment(1) | size._asdict() | {"epoch_boundaries": boundaries, "compile_s": run.compile_s}
    rows = []
    for feed, runs in times.items():
        seconds = statistics.median(t for t, _, _ in runs)
        rate = size.global_batch / seconds
        rows.append(env | {
            "feed": feed, "ms_per_step": seconds * 1e3, "ms_per_step_repeats": [t * 1e3 for t, _, _ in runs],
            "input_wait_ms_per_step": statistics.median(w for _, w, _ in runs) * 1e3,
            "examples_per_sec": rate, "final_loss": runs[0][2], "final_losses": [x for _, _, x in runs],
            "vs_prestaged": seconds * 1e3 / (rows[0]["ms_per_step"] if rows else seconds * 1e3),
        } | ({"tokens_per_sec": rate * tokens_per_example(run.trial)} if lm else {}))  # fmt: skip
        wait_s = rows[-1]["input_wait_ms_per_step"] / 1e3
        if lm and wait_s > 0 and feed != "pre-staged":  # what the feed alone makes per second of waiting
            rows[-1]["feed_tokens_per_sec"] = size.global_batch * tokens_per_example(run.trial) / wait_s
    return rows


def ingest_benchmark(args, sizes: list[IngestSize]) -> Report:
    """Rows per size, in a local Ray (started and stopped unless one runs); without ``--parquet`` each
    dataset is prepared into a temporary folder, removed afterwards."""
    if started := not ray.is_initialized():  # "local": never the last cluster /tmp/ray names, maybe gone
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # each dataset's plan: not the report's
    tmp = tempfile.mkdtemp(prefix="jaxray-ingest-")

    def run(size: IngestSize) -> dict:
        folder = args.parquet or f"{tmp}/{size.workload}"
        if args.parquet is None:
            prepare(DATASET[size.workload], folder, args.data_dir, size.seq_len)
        return {"rows": _rows(_Run(size, folder, args.data_dir, args.prefetch_batches))}

    try:
        results = run_cases([({"workload": s.workload}, lambda s=s: run(s)) for s in sizes], "ingest")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if started:  # dropped Ray Data iterators call Ray when finalized: not after shutdown (auto-init)
            gc.collect()
            ray.shutdown()
    rows = [r for res in results for r in res.pop("rows", [res])]
    streamed = [r for r in rows if r.get("feed") in STREAMED]
    summary = {f"{r['workload']}_ratio": r["vs_prestaged"] for r in streamed} | {"target": TARGET}
    notes = [
        f"Target: ray data ms/step <= {TARGET:g} x pre-staged. ray data reads the split once, "
        "every epoch drawn in host memory; in memory: no Ray, the host cost of placing a batch.",
        "input wait: time spent getting the next batch per timed step; epoch ends timed: epoch "
        "boundaries inside the timed window. Equal final losses show the batches are the same.",
    ]
    notes += [f"{r['workload']}, {r['feed']}: {r['vs_prestaged']:.3g}x pre-staged, target "
              f"{'met' if r['vs_prestaged'] <= TARGET else 'missed'}" for r in streamed]  # fmt: skip
    staged = {r["workload"]: r.get("final_losses") for r in rows if r.get("feed") == "pre-staged"}
    notes += [f"{r['workload']}, {r['feed']}: final losses differ from pre-staged" for r in streamed
              if r.get("final_losses") != staged.get(r["workload"])]  # fmt: skip
    title = "Ingest: pre-staged device batches vs Ray Data from Parquet"
    return Report("ingest", title, rows, COLUMNS, notes, summary=summary)
