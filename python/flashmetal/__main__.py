"""``python -m flashmetal``: the flashmetal command (flashmetal.cli)."""
from .cli import main

raise SystemExit(main())
