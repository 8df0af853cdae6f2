"""Entry point: ``agentgw serve retrieval`` or ``python -m retrieval.main``."""

from __future__ import annotations

import sys

from servicekit.server import main_for

from retrieval.service import RetrievalApp
from retrieval.settings import RetrievalSettings


def main() -> int:
    return main_for(RetrievalSettings, RetrievalApp)


if __name__ == "__main__":
    sys.exit(main())
