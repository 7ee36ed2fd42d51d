from dsgpt2.cli import main

raise SystemExit(main())
