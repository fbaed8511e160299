"""What .ci/run checks of the installed wheel, run by the wheel's venv with ``python -I`` from
outside the source tree (so nothing is imported from it):

    python -I .ci/wheel_check.py installed ROOT     every package of ROOT's tree comes from
                                                    site-packages, with every file it reads
                                                    (C kernel sources: every kernel builds)
    python -I .ci/wheel_check.py make-lora DIR      a random PEFT LoRA adapter for the default
                                                    model, with numpy and safetensors only
                                                    (peft is a test extra)
    python -I .ci/wheel_check.py requests TARGET LORA   a LoRA request (its greedy text differs
                                                    from the base model's), a speculated one
                                                    (drafts verified) and a structured one
                                                    (the regex matches), to a serving worker

Exit 1 with the reason on stderr when a check fails.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

# What the tree holds but the wheel does not ship: the tests, and the protos' generator.
NOT_PACKAGED = ("tests",)
PYTHON_ONLY = ("benchmarks",)  # ships its modules; a helper script there is not run installed


def fail(why: str) -> None:
    print(f"wheel check FAILED: {why}", file=sys.stderr)
    raise SystemExit(1)


def tree_packages(root: Path) -> dict[str, Path]:
    """{package: folder} for every tracked __init__.py of the tree (protos/llmworker is the
    package llmworker), found independently of pyproject's discovery."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard",
                             "*__init__.py"], capture_output=True, text=True, check=True).stdout
    out = {}
    for line in listed.split():
        folder = Path(line).parent
        parts = folder.parts[1:] if folder.parts[:1] == ("protos",) else folder.parts
        if parts and parts[0] not in NOT_PACKAGED:
            out[".".join(parts)] = root / folder
    return out


def installed(root: Path) -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for pth in site.glob("*.pth"):  # an editable install left behind would read the tree
        if str(root) in pth.read_text(errors="replace"):
            fail(f"{pth.name} points at the source tree {root}")
    packages = tree_packages(root)
    tracked = set(subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard"],
                                 capture_output=True, text=True, check=True).stdout.split())
    problems = []
    for name, folder in sorted(packages.items()):
        try:
            spec = importlib.util.find_spec(name)
        except ImportError as e:
            spec, why = None, f"{type(e).__name__}: {e}"
        else:
            why = "not found"
        if spec is None or spec.origin is None:
            problems.append(f"{name}: {why} (not in the wheel?)")
            continue
        where = Path(spec.origin).resolve().parent
        if not where.is_relative_to(site):
            problems.append(f"{name} imported from {where}, not from {site}")
            continue
        if name.split(".")[0] in PYTHON_ONLY:
            continue
        for f in sorted(folder.iterdir()):  # every file the package reads at run time
            rel = f.relative_to(root).as_posix()
            if f.is_file() and rel in tracked and not (where / f.name).is_file():
                problems.append(f"{name}: {f.name} is not installed beside it")
    if problems:
        fail("the installed wheel lacks what the tree has:\n  " + "\n  ".join(problems))
    from ops import cpu_kernels  # every kernel builds from the installed sources

    if cpu_kernels.isa() is not None:
        names = sorted(p.stem for p in Path(cpu_kernels.__file__).parent.glob("*.c"))
        broken = [k for k in names if cpu_kernels.load(k) is None]
        if not names or broken:
            fail(f"C kernels that do not build from the installed sources: {broken or names}")
    print(f"installed: {len(packages)} packages, all from {site}")


def _field(reader, key: str) -> int:
    f = reader.fields[key]
    return int(f.parts[f.data[0]][0])


def make_lora(folder: Path) -> None:
    """A rank-8 adapter on q_proj and v_proj of every layer, shaped from the default model's
    GGUF header, in PEFT's layout (adapter_config.json, adapter_model.safetensors)."""
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    from worker.weights import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    hidden = _field(reader, f"{arch}.embedding_length")
    layers = _field(reader, f"{arch}.block_count")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    rank, out = 8, {"q_proj": hidden, "v_proj": kv_heads * (hidden // heads)}
    rng = np.random.default_rng(48)
    tensors = {}
    for i in range(layers):
        for proj, n_out in out.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) /
                                               np.sqrt(hidden)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.5 * rng.standard_normal((n_out, rank))
                                               ).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(out), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "base_model_name_or_path": "SmolLM2-135M-Instruct"}))
    print(f"make-lora: rank {rank} on {', '.join(out)} of {layers} layers -> {folder}")


def requests(target: str, lora: str) -> None:
    from clients.client import CompletionBuilder, WorkerClient, build_generate_request

    def ask(prompt: str, max_tokens: int, **fields: str):
        req = build_generate_request(prompt, max_tokens=max_tokens, temperature=0.0)
        for k, v in fields.items():
            setattr(req, k, v)
        acc = CompletionBuilder()
        for resp in client.generate_request(req, timeout=120):
            acc.add(resp)
        c = acc.result()
        if c.finish_reason not in ("stop", "length"):
            fail(f"{fields or 'base'}: finish {c.finish_reason} {c.error_message}")
        return c

    with WorkerClient(target) as client:
        prompt = "The capital of France is"
        base = ask(prompt, 12)
        adapted = ask(prompt, 12, lora_name=lora)
        print(f"base:   {base.text!r}\nLoRA {lora}: {adapted.text!r}")
        if adapted.token_ids == base.token_ids:
            fail("the LoRA request's greedy tokens equal the base model's: no adapter applied")
        text = "one two three four five six seven eight " * 4
        spec = ask(text, 24)
        print(f"speculation: {spec.spec_accepted_tokens} of {spec.spec_draft_tokens} drafts "
              "accepted")
        if spec.spec_draft_tokens <= 0:
            fail("no draft token verified on a repeating prompt: speculation did not run")
        pattern = r"[A-Z]{3}-[0-9]{4}"
        code = ask("A product code:", 16, regex=pattern)
        print(f"structured (regex {pattern}): {code.text!r}")
        if not re.fullmatch(pattern, code.text):
            fail(f"the structured output {code.text!r} does not match {pattern}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["installed"] and len(argv) == 2:
        installed(Path(argv[1]).resolve())
    elif argv[:1] == ["make-lora"] and len(argv) == 2:
        make_lora(Path(argv[1]))
    elif argv[:1] == ["requests"] and len(argv) == 3:
        requests(argv[1], argv[2])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
