"""loadgen tests import their helpers (stub_server.py, loadgen_fixtures.py) from this directory,
whatever pytest's import mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
