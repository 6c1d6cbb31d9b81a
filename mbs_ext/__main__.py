from mbs_ext.cli import main

raise SystemExit(main())
