"""``python -m jaxray.bench NAME``: the learning path's measurements (see ``__main__``)."""
