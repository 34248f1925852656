"""``python -m astrai`` runs the ``astrai-ops`` command line."""

from astrai.cli import main

raise SystemExit(main())
