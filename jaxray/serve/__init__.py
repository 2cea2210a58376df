"""The Ray Serve application for the trained transformer (see ``docs/serving.md``). Nothing is
imported here, so ``jaxray.serve.schema`` loads without Ray or JAX.

  schema     request/response models, limits, the error format      routes   the FastAPI app, SSE
  playground GET /: the browser page streaming /generate            openai   the /v1 OpenAI routes
  metrics    Prometheus via Ray
  (the engine loop, ``jaxray.inference.scheduler``, and ``detokenize`` are inference's)
  requests   a replica's request path (body -> engine requests -> token streams), every route's
  replica    one replica: its engine, Serve's batching, the routes
  app        the checks, deployment options and ``app_builder`` (``serve run serve/config.yaml``)
  python -m jaxray.serve --checkpoint PATH   the same app from one command
"""
