from treadle.cli import main

raise SystemExit(main())
