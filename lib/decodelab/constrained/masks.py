"""Former home of the mask engines, kept only for importers not yet moved to the new homes:
`constrained.constraint` (Constraint, ConstraintError, UnsupportedConstraint), `constrained.bitmask`
(apply_bitmask, ...) and `constrained.engines` (MaskEngine, BatchMasker, make_engine, one module per engine).
Import from those; this module goes once constrained/decode.py and tests/constrained/test_constrained.py do.
"""
from __future__ import annotations

from decodelab.constrained.bitmask import apply_bitmask
from decodelab.constrained.constraint import Constraint, ConstraintError, UnsupportedConstraint
from decodelab.constrained.engines import (
    BatchMasker,
    LLGuidanceEngine,
    MaskEngine,
    XGrammarEngine,
    make_engine,
)

__all__ = ["BatchMasker", "Constraint", "ConstraintError", "LLGuidanceEngine", "MaskEngine", "UnsupportedConstraint",
           "XGrammarEngine", "apply_bitmask", "make_engine"]
