"""An example kernel package for astrai (see ``tables/rms_norm.yaml``)."""

__version__ = "0.1.0"
