"""The versions quietsync runs on, checked once on import: an older torch is refused in one line, not later as
an ``AttributeError`` deep in FSDP2 or a collective."""

from __future__ import annotations

import os
import warnings

__version__ = "0.1.0"
"""quietsync's own version (re-exported as ``quietsync.__version__``)."""

TORCH_MIN = (2, 13)
"""The oldest torch the suite runs on (FSDP2's custom collectives; the flat collectives' names)."""

UNSUPPORTED_TORCH_ENV = "QUIETSYNC_UNSUPPORTED_TORCH"
"""Set to 1 to import quietsync on an older torch with a warning instead of the refusal: for a check on a machine
whose torch cannot be changed (a lent GPU's image); nothing is promised to work there."""


def check_torch(version: str) -> None:
    """Raise ``ImportError`` naming the required version when ``version`` (``torch.__version__``) is older."""
    # local tag ("+cu126") dropped and patch ignored: a patch such as "0a0" is no integer
    found = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if found < TORCH_MIN:
        need = f"{TORCH_MIN[0]}.{TORCH_MIN[1]}"
        if os.environ.get(UNSUPPORTED_TORCH_ENV, "") == "1":
            warnings.warn(f"quietsync supports torch >= {need}; running on {version} because "
                          f"{UNSUPPORTED_TORCH_ENV}=1", stacklevel=2)
            return
        raise ImportError(f"quietsync needs torch >= {need}, found {version}: pip install 'torch>={need}'")


def installed_torch() -> str:
    """torch's version from its installed metadata, without importing it (that takes seconds, and ``quietsync
    --help`` needs none of it); ``torch.__version__`` where torch has no metadata (a source checkout on the path)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        import torch

        return torch.__version__


check_torch(installed_torch())
