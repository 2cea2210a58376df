"""The Ray Serve application for the trained transformer (``docs/serving.md``): ``schema`` (requests,
limits, errors), ``routes`` (the FastAPI app, SSE), ``openai`` (the /v1 routes), ``playground``,
``metrics``, ``requests`` (a replica's request path), ``replica``, ``app`` (checks, deployment,
``app_builder``), ``python -m jaxray.serve``. Nothing is imported here, so ``jaxray.serve.schema``
loads without Ray or JAX."""
