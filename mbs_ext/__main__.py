from mbs_ext.apps.cli import main

raise SystemExit(main())
