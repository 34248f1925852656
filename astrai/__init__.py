"""astrai: a declarative operator dispatcher for PyTorch.

Import ``astrai.dispatch`` for the engine and ``astrai.ops`` for the op facades. A
reference such as "contract §3" in the code is a section of ``docs/contract.md``, the
design contract the code keeps.
"""

from __future__ import annotations

from typing import Any

from astrai.version import __version__

__all__ = ["__version__", "tune_model"]


def __getattr__(name: str) -> Any:
    """``astrai.tune_model`` (``astrai.tune.model``), imported on first use: importing
    ``astrai`` loads neither torch nor transformers."""
    if name == "tune_model":  # by name, as ``astrai.dispatch`` loads its workflows
        import importlib

        return importlib.import_module("astrai.tune.model").tune_model
    raise AttributeError(f"module 'astrai' has no attribute {name!r}")
