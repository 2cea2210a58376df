"""The Ray Serve application for the trained transformer (``docs/serving.md``). Nothing is imported
here, so ``jaxray.serve.schema`` loads without Ray or JAX."""
