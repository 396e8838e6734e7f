"""kvx as a vLLM KV connector: ``kvx.vllm.KvxConnector`` (vLLM 0.32, ``KVConnectorBase_V1``)."""

from kvx.vllm.connector import KvxConnector
from kvx.vllm.meta import KvxConnectorMetadata, KvxWorkerMetadata

__all__ = ["KvxConnector", "KvxConnectorMetadata", "KvxWorkerMetadata"]
