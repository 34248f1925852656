"""Decision locks: the lock's values and file (``model``), making a lock from a recorded
workload and checking it against the tables in force (``make``), and enforcing the lock
``ASTR_LOCK`` names on every decision (``enforce``)."""
