"""Entry point: ``agentgw serve inference`` or ``python -m inference.main``.

vLLM's engine starts worker processes, so this module must only run its
service under the ``__main__`` guard.
"""

from __future__ import annotations

import sys

from servicekit.server import main_for

from inference.service import InferenceApp
from inference.settings import InferenceSettings


def main() -> int:
    return main_for(InferenceSettings, InferenceApp)


if __name__ == "__main__":
    sys.exit(main())
