from treadle.cli.command import main

raise SystemExit(main())
