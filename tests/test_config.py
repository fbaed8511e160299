"""One tree of frozen dataclasses; every leaf is a flag and an LLMWORKER_* variable."""

from __future__ import annotations

import dataclasses

import pytest

from worker import config as cfgmod
from worker.cli import build_parser


def _leaves() -> list[tuple[str, str]]:
    return [(section, f.name)
            for section, cls in cfgmod._sections() for f in dataclasses.fields(cls)]


def test_every_setting_is_a_flag_with_its_variable_in_help() -> None:
    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = sub.format_help()
    aliases = [f.metadata["alias"].name for _s, cls in cfgmod._sections()
               for f in dataclasses.fields(cls) if f.metadata["alias"]]
    assert aliases  # --enforce-eager at least
    for name in [n for _section, n in _leaves()] + aliases:
        assert "--" + name.replace("_", "-") in text, name
        assert "LLMWORKER_" + name.upper() in text, name


def test_every_section_is_printed_in_the_config_dump() -> None:
    conf = cfgmod.from_args(build_parser().parse_args(["serve", "-tp", "1"]))
    assert set(conf.to_dict()) == {section for section, _cls in cfgmod._sections()}
    assert conf.to_dict()["parallel"] == {"tensor_parallel_size": 1,
                                          "distributed_timeout_seconds": 60.0}


def test_environment_sets_defaults_and_flags_win(monkeypatch) -> None:
    monkeypatch.setenv("LLMWORKER_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("LLMWORKER_REFLECTION", "false")
    conf = cfgmod.from_args(build_parser().parse_args(["serve"]))
    assert conf.scheduler.max_num_seqs == 7 and conf.server.reflection is False
    conf = cfgmod.from_args(build_parser().parse_args(["serve", "--max-num-seqs", "3"]))
    assert conf.scheduler.max_num_seqs == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        conf.scheduler.max_num_seqs = 4  # type: ignore[misc]


def test_bad_values_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--block-size must be a power of two"):
        cfgmod.CacheConfig(block_size=12)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        cfgmod.SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization must be in \(0, 1\], got 1.5"):
        cfgmod.CacheConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="--kv-cache-free-memory-fraction must be in"):
        cfgmod.CacheConfig(kv_cache_free_memory_fraction=-0.1)


def test_bad_boolean_variable_names_the_variable(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LLMWORKER_REFLECTION", "maybe")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    err = capsys.readouterr().err
    assert "LLMWORKER_REFLECTION='maybe': not a boolean: 'maybe'" in err


@pytest.mark.parametrize("argv", [
    ["--drain-grace-s", "nan"],  # compared false with everything: SIGTERM aborted every request
    ["--max-generation-time-s", "inf"],
    ["--swap-space", "nan"],
    ["--kv-cache-memory", "inf"],
])
def test_every_float_flag_refuses_what_is_not_finite(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert f"argument {argv[0]}: {argv[1]!r} is not a finite number" in capsys.readouterr().err


def test_a_float_variable_refuses_nan(monkeypatch, capsys) -> None:
    monkeypatch.setenv("LLMWORKER_DRAIN_GRACE_S", "NaN")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    assert "LLMWORKER_DRAIN_GRACE_S='NaN': 'NaN' is not a finite number" in capsys.readouterr().err


def test_counts_and_seeds_past_what_the_wire_and_torch_hold_are_refused() -> None:
    """--max-num-seqs 10^20 started, and every GetLoads (a uint32 count) failed."""
    with pytest.raises(ValueError, match=r"--max-num-seqs must be in \[1, 2147483647\]"):
        cfgmod.SchedulerConfig(max_num_seqs=10**20)
    with pytest.raises(ValueError, match=r"--seed must be in \[0, 2\^63\)"):
        cfgmod.ModelConfig(seed=2**64)
    with pytest.raises(ValueError, match="--max-message-bytes must be in"):
        cfgmod.ServerConfig(max_message_bytes=3 * 10**9)


def test_tokens_are_stripped_and_must_be_sendable() -> None:
    """A token from a Secret file ends in a newline, which no client can send: it served
    SERVING and refused every call. Stripped now; one with a character metadata cannot carry
    is refused at start, without echoing it."""
    assert cfgmod.ServerConfig(auth_token="s3cret\n", admin_token=" adm ").auth_token == "s3cret"
    assert cfgmod.ServerConfig(admin_token=" adm \n").admin_token == "adm"
    for bad in ("s\u00e9cret", "a\x00b", "tab\there"):
        with pytest.raises(ValueError, match="--auth-token holds a character") as e:
            cfgmod.ServerConfig(auth_token=bad)
        assert bad not in str(e.value)


def test_device_and_max_model_len_spellings_are_checked_at_start() -> None:
    """--device tpu and --max-model-len 1 ended in a traceback (torch's, an assertion)."""
    with pytest.raises(ValueError, match="--device must be cpu, cuda, cuda:N or auto, got 'tpu'"):
        cfgmod.ModelConfig(device="tpu")
    with pytest.raises(ValueError, match=r"--max-model-len must be 0 \(the model's own\) or >= 2"):
        cfgmod.ModelConfig(max_model_len=1)
    for ok in ("auto", "cpu", "cuda", "cuda:3"):
        assert cfgmod.ModelConfig(device=ok).device == ok


def test_a_cuda_device_without_cuda_is_one_clear_error() -> None:
    import torch

    from worker.engine import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="--device cuda:0: no CUDA device here"):
        resolve_device("cuda:0")


def test_a_cpu_kv_cache_past_the_hosts_memory_is_one_clear_error(monkeypatch) -> None:
    """40 GB on a 23 GiB host was killed by the OOM killer without a word."""
    from worker import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 8 << 30)
    memory.check_host_room(4 << 30)
    with pytest.raises(ValueError, match=r"\(40.00 GiB\) is more than this host has available \(8.00 GiB\)"):
        memory.check_host_room(40 << 30)
    monkeypatch.undo()
    real = memory.host_available_bytes()  # this host's own reading, where Linux gives one
    assert real is None or real > 0
