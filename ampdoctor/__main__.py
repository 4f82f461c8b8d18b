"""`python -m ampdoctor` = the `ampdoctor` command."""
from .cli import main

raise SystemExit(main())
