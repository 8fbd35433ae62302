"""The cluster tests compare the ingress with the single server: its helpers and bad-input
cases (tests/server) are importable from here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
