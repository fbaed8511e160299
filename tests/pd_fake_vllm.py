"""A worker that describes itself to SMG as a real vLLM NIXL worker does (GetServerInfo:
kv_connector NixlConnector, kv_role kv_both, kv_cache_dtype "auto", no attention backend
named, no pairing protocol): what SMG must never pair one of ours with
(tests/test_smg_pd.py). Run as ``python -m tests.pd_fake_vllm serve ...``."""

from __future__ import annotations

import sys

from worker import vllm_service
from worker.cli import main

_info = vllm_service.VllmEngineServicer.GetServerInfo


async def _as_vllm_nixl(self, request, context):
    info = await _info(self, request, context)
    info.kv_connector, info.kv_role, info.kv_engine_id = "NixlConnector", "kv_both", "vllm-0"
    info.kv_cache_dtype, info.attention_backend, info.pairing_protocol = "auto", "", ""
    return info


vllm_service.VllmEngineServicer.GetServerInfo = _as_vllm_nixl

if __name__ == "__main__":
    sys.exit(main())
