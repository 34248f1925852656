"""Plan agreement across the ranks of a ``torch.distributed`` job: each rank's plan as a
``Fingerprint`` (``fingerprint``), how plans differ (``comparison``), the byte collective
that exchanges them (``collective``) and ``check_agreement`` (``agreement``)."""
