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
    assert conf.to_dict()["parallel"] == {"tensor_parallel_size": 1}


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
