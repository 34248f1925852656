"""astrai's version (``astrai.__version__``): what fingerprints, profiles and the CLI name."""

__all__ = ["__version__"]

__version__ = "0.1.0"
