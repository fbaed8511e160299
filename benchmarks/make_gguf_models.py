"""GGUF files made by the tools users make them with, into a cache directory (never the
repository), for the parity tests and the benchmarks:

    python -m benchmarks.make_gguf_models                 # the default model's variants
    python -m benchmarks.make_gguf_models --kquant --llama31 --billion --out DIR

- the default model's variants: its Q4_1 file dequantized to F32 with gguf-py (every
  metadata key kept), then llama.cpp's `llama-quantize` to Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0
  and IQ4_XS (its 576 columns are not whole 256-blocks: llama-quantize writes those tensors
  as Q5_0/Q5_1/IQ4_NL/Q8_0 and only the 1536-wide ffn_down as K-quants);
- `kquant`: a random Llama of hidden 256 (every tensor in whole 256-blocks: pure K-quants)
  saved by transformers (`LlamaConfig` + `save_pretrained`, the default model's tokenizer),
  converted by llama.cpp's `convert_hf_to_gguf.py` and quantized to Q4_K_M, Q5_K_M, Q6_K,
  Q3_K_M and Q2_K, and to IQ3_XXS and a file of every IQ1-IQ3 grid type ("IQ_MIX":
  llama-quantize's IQ2_XXS with a type per tensor named by its --tensor-type, the tied
  embedding IQ3_S); IQ1_S-IQ2_S want an importance matrix: `llama-imatrix` makes one on a fixed
  text, as users make theirs;
- `llama31`: a random Llama with Llama 3.1's rope scaling (original context 32), whose GGUF
  `convert_hf_to_gguf.py` writes with a `rope_freqs` tensor; the folder is kept (the
  reference loads it);
- `billion`: a random Llama of ~1B parameters (hidden 2048, 16 layers, 32 heads / 8 KV,
  intermediate 8192, the default model's vocabulary) written as F16 by gguf-py's
  GGUFWriter one tensor at a time, quantized to Q4_K_M, Q8_0, Q3_K_M and Q2_K (and, with
  `--billion-iq`, IQ3_XXS and IQ2_M, with an importance matrix).

`llama-quantize` and `convert_hf_to_gguf.py` come from the llama.cpp vendored in the
llama-cpp-python 0.3.36 sdist (PyPI): found where $LLAMA_CPP_DIR or
../shared/tools/build_llamacpp.sh put it, else (`tools(build=True)`) that sdist is fetched
with pip and only llama-quantize is built (cmake, a C++ compiler). Every file is made once:
an existing file of the same name is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SDIST_VERSION = "0.3.36"
DEFAULT_VARIANTS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "IQ4_XS")
KQUANT_VARIANTS = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K")
# The IQ1-IQ3 files (of the same model): IQ3_XXS as llama-quantize makes it (IQ3_XXS, IQ2_S and
# IQ3_S tensors), and IQ_MIX, every grid type in one file: llama-quantize's arguments for it.
IQ_VARIANTS = ("IQ3_XXS", "IQ_MIX")
MIXES = {"IQ_MIX": ("IQ2_XXS", ["--token-embedding-type", "iq3_s", "--tensor-type", "attn_q=iq1_s",
                                "--tensor-type", "attn_k=iq1_m", "--tensor-type", "attn_v=iq2_xs",
                                "--tensor-type", "attn_output=iq2_s", "--tensor-type", "ffn_gate=iq3_xxs",
                                "--tensor-type", "ffn_up=iq3_s", "--tensor-type", "ffn_down=iq2_xxs"])}
BILLION_IQ_VARIANTS = ("IQ3_XXS", "IQ2_M")
# The file types llama-quantize refuses without an importance matrix (and IQ3_XXS's, whose
# attn_v it writes as IQ2_S): llama-imatrix's is used for all of IQ_VARIANTS.
_WANT_IMATRIX = ("IQ1", "IQ2", "IQ3", "Q2_K_S")
# Bump when a file's recipe changes: the cache keeps files by name.
RECIPE = "v1"


def cache_dir() -> Path:
    """$LLMWORKER_GGUF_CACHE, else ~/.cache/llm-worker/gguf-models."""
    env = os.environ.get("LLMWORKER_GGUF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "llm-worker" / "gguf-models"


# ----- llama.cpp's tools -----

@dataclass(frozen=True)
class Tools:
    quantize: Path  # llama-quantize
    convert: Path  # convert_hf_to_gguf.py

    def _env(self) -> dict[str, str]:
        return {**os.environ, "LD_LIBRARY_PATH": f"{self.quantize.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}

    def run_quantize(self, src: Path, dst: Path, qtype: str, imatrix: Path | None = None,
                     flags: tuple[str, ...] | list[str] = ()) -> None:
        flags = [*(["--imatrix", str(imatrix)] if imatrix is not None else []), *flags]
        _run([str(self.quantize), *flags, str(src), str(dst), qtype], env=self._env())

    def run_imatrix(self, model: Path, text: Path, dst: Path, chunks: int = 16) -> None:
        """llama-imatrix (built beside llama-quantize here if it is not there) on `text`."""
        tool = self.quantize.parent / "llama-imatrix"
        if not tool.is_file():
            _run(["cmake", "--build", str(self.quantize.parent.parent), "--target", "llama-imatrix",
                  f"-j{os.cpu_count() or 2}"])
        _run([str(tool), "-m", str(model), "-f", str(text), "-o", str(dst), "-c", "128", "--chunks", str(chunks),
              "-t", str(os.cpu_count() or 2)], env=self._env())

    def run_convert(self, folder: Path, dst: Path, outtype: str = "f32") -> None:
        _run([sys.executable, str(self.convert), str(folder), "--outfile", str(dst), "--outtype", outtype])


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)[:300]} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _tree_candidates() -> list[Path]:
    out = []
    if os.environ.get("LLAMA_CPP_DIR"):
        out.append(Path(os.environ["LLAMA_CPP_DIR"]))
    for root in (Path.home() / ".cache" / "llamacpp-peer", cache_dir().parent / "llamacpp"):
        out.append(root / "lcsrc" / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp")
    return out


def find_tools() -> Tools | None:
    """llama-quantize and convert_hf_to_gguf.py where a build left them; None if nowhere."""
    for tree in _tree_candidates():
        q, c = tree / "build" / "bin" / "llama-quantize", tree / "convert_hf_to_gguf.py"
        if q.is_file() and os.access(q, os.X_OK) and c.is_file():
            return Tools(q, c)
    return None


def find_converter() -> Tools | None:
    """Tools whose convert_hf_to_gguf.py is there (a Python script on gguf-py: nothing to
    build), llama-quantize built or not (run_quantize fails saying so if not); None if no
    tree has the script."""
    for tree in _tree_candidates():
        if (tree / "convert_hf_to_gguf.py").is_file():
            return Tools(tree / "build" / "bin" / "llama-quantize", tree / "convert_hf_to_gguf.py")
    return None


def build_tools(log=print) -> Tools:
    """Fetch the llama-cpp-python sdist with pip and build only llama-quantize (Release,
    native ISA) under the cache; returns the tools (RuntimeError saying what failed)."""
    root = cache_dir().parent / "llamacpp"
    tree = root / "lcsrc" / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
    for tool in ("cmake", "make"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-quantize needs {tool} (apt-get install cmake g++ make)")
    dl = root / "dl"
    sdist = dl / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
    t0 = time.monotonic()
    if not sdist.is_file():
        dl.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={SDIST_VERSION}", "-d", str(dl)])
    if not (tree / "CMakeLists.txt").is_file():
        (root / "lcsrc").mkdir(parents=True, exist_ok=True)
        _run(["tar", "xzf", str(sdist), "-C", str(root / "lcsrc")])
    build = tree / "build"
    if not (build / "CMakeCache.txt").is_file():
        _run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"])
    _run(["cmake", "--build", str(build), "--target", "llama-quantize", "llama-imatrix", f"-j{os.cpu_count() or 2}"])
    log(f"built llama-quantize in {time.monotonic() - t0:.0f}s: {build / 'bin' / 'llama-quantize'}")
    tools = find_tools()
    if tools is None:
        raise RuntimeError(f"llama-quantize was not built under {build}")
    return tools


def tools(build: bool = False) -> Tools | None:
    found = find_tools()
    return found if found is not None or not build else build_tools()


# ----- files -----

def _part(dst: Path) -> Path:
    """Where `dst` is written before its rename: one per process, so two makers at once (the
    cache is shared) never write into one file; the later rename wins, both whole."""
    return dst.with_name(f"{dst.name}.part-{os.getpid()}")


def _tokenizer_folder(folder: Path) -> None:
    """The default model's tokenizer as a Hugging Face folder holds it (the files the worker
    rebuilds from its GGUF; convert_hf_to_gguf recognises its pre-tokenizer as smollm)."""
    from worker.tokenizer import Tokenizer
    from worker.tokenizer_bundle import gguf_files
    from worker.weights import default_model_path

    for name, data in gguf_files(Tokenizer.from_gguf(default_model_path()), 8192).items():
        (folder / name).write_bytes(data)


def default_f32(out: Path) -> Path:
    """The default model's GGUF with every tensor dequantized to F32 by gguf-py, every other
    metadata key as it was (the input llama-quantize wants)."""
    import gguf

    from worker.weights import default_model_path

    dst = out / f"default-F32-{RECIPE}.gguf"
    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(str(default_model_path()))
    arch = reader.fields["general.architecture"].contents()
    tmp = _part(dst)
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, f.types[0], sub_type=sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, values.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def quantized(tools_: Tools, src: Path, qtype: str) -> Path:
    dst = src.with_name(src.name.replace("-F32-", f"-{qtype}-").replace("-F16-", f"-{qtype}-"))
    if not dst.is_file():
        tmp = _part(dst)
        ftype, flags = MIXES.get(qtype, (qtype, []))
        imatrix = importance_matrix(tools_, src) if ftype.startswith(_WANT_IMATRIX) else None
        tools_.run_quantize(src, tmp, ftype, imatrix, flags)
        tmp.rename(dst)
    return dst


def _imatrix_text(dst: Path, tokens: int = 4096, seed: int = 0) -> Path:
    """A fixed text for llama-imatrix: the default model's vocabulary, tokens drawn at random
    with a fixed seed (the models here are random: any text serves, and this one never changes)."""
    if not dst.is_file():
        from worker.tokenizer import Tokenizer
        from worker.weights import default_model_path

        tok = Tokenizer.from_gguf(default_model_path())
        ids = np.random.default_rng(seed).integers(100, 49152, tokens).tolist()
        tmp = _part(dst)
        tmp.write_text(tok.decode(ids))
        tmp.rename(dst)
    return dst


def importance_matrix(tools_: Tools, src: Path) -> Path:
    """llama-imatrix's importance matrix of `src` (an F32/F16 GGUF) on the fixed text, kept beside it."""
    dst = src.with_name(src.name.replace(".gguf", ".imatrix.gguf"))
    if not dst.is_file():
        tmp = _part(dst)
        tools_.run_imatrix(src, _imatrix_text(src.parent / f"imatrix-text-{RECIPE}.txt"), tmp)
        tmp.rename(dst)
    return dst


def default_variants(tools_: Tools, out: Path, qtypes: tuple[str, ...] = DEFAULT_VARIANTS) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    src = default_f32(out)
    return {q: quantized(tools_, src, q) for q in qtypes}


def random_llama_folder(folder: Path, seed: int = 0, std: float = 0.02, **config: Any) -> Path:
    """A random transformers Llama (`LlamaConfig(**config)`, weights N(0, std), norms 1) saved
    with `save_pretrained`, with the default model's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    tmp = _part(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, initializer_range=std, **config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp)
    _tokenizer_folder(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another maker's rename came first: keep its folder
        if not (folder / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def converted(tools_: Tools, folder: Path, name: str, outtype: str = "f32") -> Path:
    dst = folder.parent / f"{name}-{outtype.upper()}-{RECIPE}.gguf"
    if not dst.is_file():
        tmp = _part(dst)
        tools_.run_convert(folder, tmp, outtype)
        tmp.rename(dst)
    return dst


KQUANT_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=True)
LLAMA31_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
BILLION_CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0)


def kquant_model(tools_: Tools, out: Path, qtypes: tuple[str, ...] = KQUANT_VARIANTS + IQ_VARIANTS) -> dict[str, Path]:
    """The pure K-quant model: F32 from convert_hf_to_gguf, then llama-quantize (std 0.1:
    logits far enough apart that greedy tokens are not near-ties)."""
    folder = random_llama_folder(out / f"kquant-hf-{RECIPE}", seed=1, std=0.1, **KQUANT_CONFIG)
    src = converted(tools_, folder, "kquant")
    return {"folder": folder, "F32": src, **{q: quantized(tools_, src, q) for q in qtypes}}


def llama31_model(tools_: Tools, out: Path) -> dict[str, Path]:
    folder = random_llama_folder(out / f"llama31-hf-{RECIPE}", seed=2, std=0.1, **LLAMA31_CONFIG)
    return {"folder": folder, "F32": converted(tools_, folder, "llama31")}


def billion_f16(out: Path, seed: int = 0) -> Path:
    """~1B parameters, F16, written one tensor at a time (the whole model is never in memory):
    weights N(0, 0.02), norms 1, the default model's tokenizer and chat template."""
    import gguf

    from worker.weights import default_model_path

    dst = out / f"billion-F16-{RECIPE}.gguf"
    if dst.is_file():
        return dst
    c = BILLION_CONFIG
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    src = gguf.GGUFReader(str(default_model_path()))
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab, h)), ("output_norm.weight", (h,))]
    for i in range(layers):
        shapes += [(f"blk.{i}.{n}", s) for n, s in (
            ("attn_norm.weight", (h,)), ("attn_q.weight", (heads * d, h)), ("attn_k.weight", (kv * d, h)),
            ("attn_v.weight", (kv * d, h)), ("attn_output.weight", (h, heads * d)), ("ffn_norm.weight", (h,)),
            ("ffn_gate.weight", (inter, h)), ("ffn_up.weight", (inter, h)), ("ffn_down.weight", (h, inter)))]
    tmp = _part(dst)
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("random-llama-1b")
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, f in src.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for name, shape in shapes:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for _, shape in shapes:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
        else:
            w.write_tensor_data(rng.standard_normal(shape, dtype=np.float32).astype(np.float16) * np.float16(0.02))
    w.close()
    tmp.rename(dst)
    return dst


def billion_model(tools_: Tools, out: Path, iq: bool = False) -> dict[str, Path]:
    src = billion_f16(out)
    qtypes = ("Q4_K_M", "Q8_0", "Q3_K_M", "Q2_K") + (BILLION_IQ_VARIANTS if iq else ())
    return {"F16": src, **{q: quantized(tools_, src, q) for q in qtypes}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="where the files go (default: the cache)")
    ap.add_argument("--no-default", action="store_true", help="skip the default model's variants")
    ap.add_argument("--kquant", action="store_true", help="the pure K-quant random model")
    ap.add_argument("--llama31", action="store_true", help="the Llama-3.1-style random model (rope_freqs)")
    ap.add_argument("--billion", action="store_true", help="the ~1B random model (F16, Q4_K_M, Q8_0)")
    ap.add_argument("--billion-iq", action="store_true", help="the ~1B's IQ3_XXS and IQ2_M files too")
    ap.add_argument("--build", action="store_true", help="build llama-quantize if it is not found")
    args = ap.parse_args(argv)
    out = args.out or cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    t = tools(build=args.build)
    if t is None:
        print("llama-quantize not found (run ../shared/tools/build_llamacpp.sh, set LLAMA_CPP_DIR, or "
              "pass --build)", file=sys.stderr)
        return 2
    made: dict[str, Any] = {}
    t0 = time.monotonic()
    if not args.no_default:
        made["default"] = default_variants(t, out)
    if args.kquant:
        made["kquant"] = kquant_model(t, out)
    if args.llama31:
        made["llama31"] = llama31_model(t, out)
    if args.billion:
        made["billion"] = billion_model(t, out, iq=args.billion_iq)
    sizes = {group: {k: {"path": str(p), "bytes": p.stat().st_size if p.is_file() else None}
                     for k, p in files.items()} for group, files in made.items()}
    print(json.dumps({"seconds": round(time.monotonic() - t0, 1), "files": sizes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
