"""Table and profile files, from the file on disk up to the engine objects.

A table flows up one way, and no module here imports one above it:

- ``format``: the only definition of the file formats (pydantic models, which also
  validate each ``when`` through the parser) and the JSON Schemas generated from them;
- ``_yaml``: safe YAML that keeps every line and column;
- ``model``: the engine objects a file becomes (``FamilyTable``, ``ImplRecord``,
  ``Profile``, ``View``, ``Unavailable``), which is all resolution reads;
- ``artifact``: the shipped tables' folder and their precompiled artifact, read on the
  fast path (no pydantic, no YAML) and written for the CLI;
- ``load``: files -> engine objects (with ``_bind`` for ``module:attribute`` paths),
  every problem at once.

The package itself imports nothing, so importing it costs nothing.
"""
