"""Implementations behind the op facades, one module (or package) per family."""
