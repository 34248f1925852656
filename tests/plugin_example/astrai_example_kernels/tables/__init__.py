"""astrai reads the ``*.yaml`` files of this package (the ``astrai.tables`` entry point)."""
