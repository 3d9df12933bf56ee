"""The path reservation service's wire: its vocabularies (modes, load metrics, when a
lane is reserved). Every part that names one of them imports it from here.

(Issue 17: the routes and the request/answer types join these here.)
"""

from __future__ import annotations

from typing import Final

MODES: Final = ("ecmp", "cc", "dc")  # hash-chosen lane, central decision, distributed decision
METRICS: Final = ("flows", "bytes")  # what cc/dc count on a link when they compare lanes
RESERVE_AT: Final = ("admission", "push")  # the proxy reserves at admission, or P's connector at push start
