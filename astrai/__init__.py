"""astrai: a declarative operator dispatcher for PyTorch.

Import ``astrai.dispatch`` for the engine and ``astrai.ops`` for the op facades.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
