"""The Ray adapters around one training run (``jaxray.train.run.train``), in the order a sweep uses them:

  sweep     the Tune driver: the grid, one trial function per point, scheduler and concurrency
  trainer   ``make_trainer``: the ``JaxTrainer`` for one trial, its workers' environment
  worker    ``train_loop_per_worker``: config, rank, mesh, data shard, restore, loop, final save
  shards    each worker's batches (Ray Data shards or the prepared Parquet files)
  reports   the loop hooks that report metrics and checkpoints to Ray and write compile.json
  resume    which checkpoint a restarted worker restores
  faults    fault injection for the recovery tests (kill a worker, damage a checkpoint)
  cluster   joining the CPU multi-process program, probing the cluster through public Ray APIs

Nothing is imported here.
"""
