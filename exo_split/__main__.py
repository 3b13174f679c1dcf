from exo_split.cli.main import main

raise SystemExit(main())
