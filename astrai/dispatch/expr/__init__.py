"""The spec expression language (contract §4): ``_tokenizer`` (tokens on demand) ->
``_parser`` (text -> ``Spec``, type-checked against a vocabulary) -> ``spec`` (the
combinators, the canonical printer, the plain encoding); ``definitions`` builds a table's
named sub-expressions (``define:``). Import from ``spec`` and ``definitions``."""
