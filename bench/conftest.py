"""Make bench/ helper modules importable by the studies."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
