import sys
from pathlib import Path

# cases.py and ports.py (shared by tests/unit, tests/vllm and tests/engine).
sys.path.insert(0, str(Path(__file__).parent))
