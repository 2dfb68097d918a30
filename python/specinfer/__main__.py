from specinfer.cli import main

raise SystemExit(main())
