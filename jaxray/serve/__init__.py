"""The Ray Serve application for the trained transformer (see ``docs/serving.md``).

  jaxray.serve.schema    request/response models, limits, the error format (no Ray, no JAX)
  jaxray.serve.routes    the FastAPI app, its error handlers, body reading, SSE streams (no Ray, no JAX)
  jaxray.serve.playground GET /: the browser page streaming /generate (no Ray, no JAX)
  jaxray.serve.scheduler continuous batching fed by Serve's batches, on one engine thread
  jaxray.serve.metrics   Prometheus metrics through Ray's metrics agent (no JAX)
  jaxray.serve.app       the deployment, its routes and ``app_builder`` for ``serve run serve/config.yaml``
  python -m jaxray.serve --checkpoint PATH   the same app from one command

Nothing is imported here, so ``jaxray.serve.schema`` loads without Ray or JAX.
"""
