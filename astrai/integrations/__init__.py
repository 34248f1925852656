"""Plug-ins that route third-party model code through astrai's op facades.

Nothing here activates on import: each integration exposes a ``register()`` to call
explicitly. ``astrai.integrations.transformers`` adds ``attn_implementation="astrai"``
to Hugging Face transformers.
"""

from __future__ import annotations

__all__: list[str] = []
