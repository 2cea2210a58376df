"""Sampling and serving a trained transformer, in the order the data flows:

  sampling          the checks, prompt window and encoding, the per-token draw, top-k, and the
                    full-recompute sampler (the learning path's recipe, the reference)
  kv_decode         prefill and ``decode_chunk`` over the KV cache, pure over the model's pair
  engine            ``Engine``: those programs compiled ahead of time per prompt bucket and batch size
  batcher           continuous batching over one engine's running batch
  scheduler         the batcher on an engine thread, fed groups of requests from asyncio (Serve)
  detokenize        byte tokens to UTF-8 text pieces, cut at stop sequences (a ``Choice``)
  artifact_loader   runs an export artifact with JAX alone (no jaxray model code, Flax or Orbax)
  load              the one dispatch: a checkpoint or an artifact path becomes an ``Engine``
  artifact          the export writer (``python -m jaxray.export``)

Nothing is imported here, so ``artifact_loader`` loads without the rest of jaxray.
"""
