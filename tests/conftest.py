import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Pushes in tests must cross a TCP connection on loopback (one per lane).
os.environ.setdefault("UCX_NET_DEVICES", "lo")
