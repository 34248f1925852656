"""astrai: a declarative operator dispatcher for PyTorch.

Import ``astrai.dispatch`` for the engine and ``astrai.ops`` for the op facades. A
reference such as "contract §3" in the code is a section of ``docs/contract.md``, the
design contract the code keeps.
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
