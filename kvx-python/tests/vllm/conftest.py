import sys
from pathlib import Path

# The platform is read once, when vLLM is first imported: with no VLLM_TARGET_DEVICE vLLM picks
# UnspecifiedPlatform (attention backends that accept any KV cache layout, the V2 model runner
# on 0.33); test_hybrid.py needs VLLM_TARGET_DEVICE=cpu (the CPU platform has a hybrid KV cache
# manager), so ci.sh runs it in a pytest process of its own.

sys.path.insert(0, str(Path(__file__).parent))
