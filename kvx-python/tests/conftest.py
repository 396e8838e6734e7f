import sys
from pathlib import Path

# cases.py (shared by tests/unit and tests/vllm).
sys.path.insert(0, str(Path(__file__).parent))
