"""Triton kernels compile for a GPU (sm_90, down to the cubin) on a machine without one.

The interpreter runs a kernel's Python, so it misses what only the compiler checks (a
global that is not a `tl.constexpr`, a type that does not unify across branches). This
compiles, in a subprocess without TRITON_INTERPRET, the sampler in every variant the
launcher uses, and the block-copy kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.helpers import requires_triton

SCRIPT = textwrap.dedent('''
    import itertools
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import ops.block_copy_triton as bc
    import ops.sampling_triton as st

    target = GPUTarget("cuda", 90, 32)

    def build(fn, sig, consts, **options):
        names = list(sig)
        src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
        kernel = triton.compile(src, target=target, options=options)
        assert kernel.asm["cubin"], fn

    ptr = lambda t: "*" + t  # noqa: E731
    sample_sig = {
        "logits_ptr": ptr("fp32"), "stride_logits": "i64", "work_ptr": ptr("fp32"),
        "prompt_ptr": ptr("u8"), "counts_ptr": ptr("fp32"), "temp_ptr": ptr("fp32"),
        "top_k_ptr": ptr("i64"), "top_p_ptr": ptr("fp32"), "min_p_ptr": ptr("fp32"),
        "rep_ptr": ptr("fp32"), "pres_ptr": ptr("fp32"), "freq_ptr": ptr("fp32"),
        "key_ptr": ptr("i64"), "token_ptr": ptr("i64"), "chosen_ptr": ptr("fp32"),
        "kept_ptr": ptr("i8"), "V": "i32",
    }
    flags = ("HAS_PENALTIES", "DO_SAMPLE", "WANT_LOGPROBS", "WRITE_KEPT")
    # Every serving variant; the tests-only WRITE_KEPT with everything else on.
    variants = [(*v, False) for v in itertools.product((True, False), repeat=3)] + [(True,) * 4]
    for values in variants:
        consts = dict(zip(flags, values), BLOCK=4096, VALUE_STEPS=st._VALUE_STEPS,
                      MAX_STEPS=st._MAX_STEPS, EPS=st.SAMPLING_EPS)
        sig = {**sample_sig, **{k: "constexpr" for k in consts}}
        build(st._sample_kernel, sig, consts, num_warps=16, enable_fp_fusion=False)
    copy_sig = {"cache_ptr": ptr("i16"), "src_ptr": ptr("i64"), "dst_ptr": ptr("i64"),
                "block_stride": "i64", "block_numel": "i32", "BLOCK": "constexpr"}
    build(bc._copy_blocks_kernel, copy_sig, {"BLOCK": 2048}, num_warps=4)
    print("compiled")
''')


@requires_triton
def test_kernels_compile_for_sm90(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
