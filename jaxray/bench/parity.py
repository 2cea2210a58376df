"""How far apart two runs' params are. The attention key bias is reported apart: its gradient is zero
(softmax ignores the q.b it adds to every score), so runs may differ there by about lr x steps (Adam)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

KEY_BIAS = "['key']['bias']"


def param_diffs(a: Any, b: Any) -> dict[str, float]:
    """``max_param_diff``: max |a - b| over every param but the key bias; ``max_key_bias_diff``:
    over the key bias (0.0 for models without attention). ``a`` and ``b``: same-structure trees."""
    diffs = {"max_param_diff": 0.0, "max_key_bias_diff": 0.0}
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        name = "max_key_bias_diff" if KEY_BIAS in jax.tree_util.keystr(path) else "max_param_diff"
        diffs[name] = max(diffs[name], float(np.max(np.abs(np.asarray(x) - np.asarray(y)))))
    return diffs
