"""Attention implementations: ``math`` (reference), ``sdpa`` (torch_native), ``flash``."""
