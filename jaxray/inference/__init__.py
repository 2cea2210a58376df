"""Sampling and serving a trained transformer, in data-flow order: settings, sampling, kv_decode,
prefix_cache, engine, batcher, scheduler, detokenize, artifact_loader, load, artifact (the export
writer). Nothing is imported here, so ``artifact_loader`` loads without the rest of jaxray."""
