from ocxproxy.cli import main

raise SystemExit(main())
