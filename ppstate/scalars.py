"""Read-only 0-d numpy constants, the scalar operands of the per-step array operations.

numpy 2.x takes a slower path for a Python ``int`` operand (``counts + 1``, ``num_sampled > 0``)
than for a 0-d array of the other operand's dtype: about 3,000 more CPU instructions per call,
measured with callgrind, on operations that cost 3,000 to 5,000 instructions in all on the arrays
of one step (issue #11: the control plane's cost per step is a few dozen such calls). With the
dtype of the array operand the result, its dtype included, is the same as with the Python int.
"""

from __future__ import annotations

import numpy as np


def _const(value: int, dtype: type) -> np.ndarray:
    a = np.array(value, dtype=dtype)   # 0-d
    a.flags.writeable = False
    return a


ZERO_I64 = _const(0, np.int64)
ONE_I64 = _const(1, np.int64)
ZERO_I32 = _const(0, np.int32)
ONE_I32 = _const(1, np.int32)
