"""Allow ``python -m npusnap_cli``."""

from npusnap_cli.cli import main

raise SystemExit(main())
