"""The field types and base class every config shares: strict integers, finite floats, frozen models
that refuse unknown keys."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict


def _finite_number(value: Any) -> Any:
    """A float field's input as given; ValueError for a boolean (pydantic would take it as 1/0) or
    NaN/infinity (checked before the range so the message says "not finite")."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):  # not a number: pydantic's own message says so
            return value
        if not math.isfinite(number):
            raise ValueError("not finite (NaN and infinity are not allowed)")
    return value


# Integers are strict (no 2.5, "10" or true); floats accept YAML's 3e-3, which PyYAML reads as text.
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
FiniteFloat = Annotated[float, BeforeValidator(_finite_number), Field(allow_inf_nan=False)]
PosFloat = Annotated[FiniteFloat, Field(gt=0)]
NonNegFloat = Annotated[FiniteFloat, Field(ge=0)]
Beta = Annotated[FiniteFloat, Field(ge=0, lt=1)]


class FrozenConfig(BaseModel):
    """Base of every config: unknown keys are errors, values cannot change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
