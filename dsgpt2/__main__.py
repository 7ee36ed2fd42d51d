from dsgpt2.cli.main import main

raise SystemExit(main())
