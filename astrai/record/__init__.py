"""Recording workloads: ``record()`` and ``ASTR_RECORD`` collect every distinct call the
facades see (``recording``) into a ``Workload`` (``workload``), saved as one YAML file
(``schemas/workload.schema.json``)."""
