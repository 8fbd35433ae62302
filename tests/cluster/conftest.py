"""The cluster tests compare the ingress with the single server: its helpers and bad-input
cases (tests/server) are importable from here. A Ray they start stays on loopback, as one
``kvserve serve --replicas`` starts (kvserve/cluster/local_ray.py): the switch is read when Ray
is imported, which the test modules do after this."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvserve.cluster.local_ray import LOCAL_ONLY_ENV

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
os.environ.setdefault(LOCAL_ONLY_ENV, "0")
