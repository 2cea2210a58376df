"""``python -m jaxray.bench``: the learning path's measurements as one command.

Modules: ``timing`` (median-of-repeats clock and the environment every row records), ``mfu``
(model FLOPs and device peaks), ``throughput`` (one workload at one config: the building block),
``suites`` (dispatch, precision, devices, shard-map, batch-sweep, attention), ``compare`` (jaxray
against the learning path's reference scripts), ``output`` (summary.json, Markdown, PNGs).
"""
