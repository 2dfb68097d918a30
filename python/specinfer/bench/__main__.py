from specinfer.bench.cli import main

raise SystemExit(main())
