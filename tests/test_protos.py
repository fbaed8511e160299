"""The checked-in stubs are what the .proto generates, and they import."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_generator() -> object:
    spec = importlib.util.spec_from_file_location("protos_generate", ROOT / "protos" / "generate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_regenerating_the_stubs_leaves_no_diff(tmp_path) -> None:
    gen = _load_generator()
    gen.generate(tmp_path)
    produced = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert produced, "protoc produced nothing"
    for rel in produced:
        checked_in = ROOT / "protos" / rel
        assert checked_in.is_file(), f"{rel} is generated but not checked in"
        assert checked_in.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale: run `python protos/generate.py` and commit the result"
        )


def test_stubs_import_as_llmworker_v1() -> None:
    from llmworker.v1 import worker_pb2, worker_pb2_grpc

    service = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
    assert {m.name for m in service.methods} >= {
        "Generate", "Abort", "GetModelInfo", "GetLoad", "GetServerStatus", "Drain"}
    assert hasattr(worker_pb2_grpc, "WorkerServiceStub")
    fields = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name
    assert fields["text"].containing_oneof.name == "input"
    assert worker_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
