"""The Ray adapters around one training run (``jaxray.train.run.train``), in the order a sweep uses
them: ``sweep`` (the Tune driver), ``trainable`` (Tune's, per trial), ``trainer`` (its
``JaxTrainer``), ``entry`` and ``worker`` (the loop per worker, its batches), ``reports`` (metrics
and checkpoints to Ray), ``resume``, ``seams`` (what a worker process's setup may add: the recovery
tests' faults), ``cluster`` (the CPU multi-process program, cluster probes through public Ray APIs).
Nothing is imported here."""
