"""The spec expression language (contract §4): ``_tokenizer`` (tokens on demand) ->
``_parser`` (text -> a spec, type-checked against a vocabulary, built through a
``Builder``) -> ``spec`` (what every spec offers; made of the forms in ``combinators``),
with ``parsing`` (the parse cache), ``encoding`` (the plain form), ``matcher`` (a spec
as one generated function) and ``analysis`` (cut points, named parts); ``definitions``
builds a table's named sub-expressions (``define:``). Import from ``spec``, ``analysis``
and ``definitions``.

Importing the package installs the forms (``combinators``) before anything makes a spec.
"""

from astrai.dispatch.expr import combinators as _combinators  # noqa: F401  (installs the forms)
