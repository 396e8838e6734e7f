import os
import sys
from pathlib import Path

# vLLM's CPU platform (its hybrid KV cache manager needs a platform that supports it; with no
# variable set vLLM picks UnspecifiedPlatform, which does not). Read when vLLM is first imported.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

sys.path.insert(0, str(Path(__file__).parent))
