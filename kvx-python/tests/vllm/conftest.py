import sys
from pathlib import Path

# The platform is read once, when vLLM is first imported: with no VLLM_TARGET_DEVICE vLLM picks
# UnspecifiedPlatform (attention backends that accept any KV cache layout, the V2 model runner
# on 0.33); test_hybrid.py needs VLLM_TARGET_DEVICE=cpu (the CPU platform has a hybrid KV cache
# manager), so ci.sh runs it in a pytest process of its own.

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_finish(session) -> None:
    """Once every test module (vLLM, torch) is imported, leave that heap out of later garbage
    collections, as vLLM's engine core does once started: a full collection of it takes
    0.2-0.38 s here, a pause in the middle of a test that bounds a step by 50 ms."""
    import gc

    gc.collect()
    gc.freeze()
