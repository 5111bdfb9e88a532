from harmonia.cli import main

raise SystemExit(main())
