"""Table and profile files, from the file on disk up to the engine objects.

A table flows up one way, and no module here imports one above it:

- ``format``: the only definition of the file formats (pydantic models, which also
  validate each ``when`` through the parser) and the JSON Schemas generated from them;
- ``_yaml``: safe YAML that keeps every line and column;
- ``model``: the engine objects a file becomes (``FamilyTable``, ``ImplRecord``,
  ``Profile``, ``View``, ``Unavailable``), which is all resolution reads;
- ``artifact``: the shipped tables' folder and their precompiled artifact, read on the
  fast path (no pydantic, no YAML) and written for the CLI;
- ``parsed``: a file on its way (``ParsedFile``): what was built, and every problem, placed
  at ``file:line:col``;
- ``build``: validated data -> engine objects (with ``_bind`` for ``module:attribute``
  paths): rows bound, ``when`` compiled, profiles checked against their families;
- ``load``: files -> validated data -> ``build``: reading the bytes safely, the format,
  the fast path from the artifact; every problem at once.

The package itself imports nothing, so importing it costs nothing.
"""
