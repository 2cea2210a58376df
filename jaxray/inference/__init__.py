"""Sampling and serving a trained transformer, in the order the data flows: ``settings``, ``sampling``
(checks, prompt window, the per-token draw, the full-recompute reference sampler), ``kv_decode`` (prefill
and ``decode_chunk`` over the KV cache), ``prefix_cache``, ``engine`` (those programs compiled per bucket
and batch size), ``batcher`` (continuous batching), ``scheduler`` (the batcher on an engine thread, fed
from asyncio), ``detokenize``, ``artifact_loader`` (an export artifact run with JAX alone), ``load`` (a
checkpoint or artifact becomes an ``Engine``), ``artifact`` (the export writer). Nothing is imported
here, so ``artifact_loader`` loads without the rest of jaxray."""
