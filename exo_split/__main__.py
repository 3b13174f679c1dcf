from exo_split.cli import main

raise SystemExit(main())
