"""``python -m orchestrator.cli``: the ``orchestrator`` program, as its console script runs it."""

import sys

from orchestrator.cli.main import orchestrator_main

if __name__ == "__main__":
    sys.exit(orchestrator_main())
