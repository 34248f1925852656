"""``astrai-ops tune``: measuring a recorded workload's rows (``measure``), bucketing the
winners into a profile (``profile``), many ranks agreeing on one plan (``ranks``), and the
run that writes, verifies and reports it (``run``, ``report``)."""
