#!/usr/bin/env bash
# Everything a lent GPU should run, in stages that each fit one 10-minute device command:
#   bash loadtest/gpu_session.sh tests     # GPU tests: kernels natively, engine on CUDA (graphs, bf16)
#   bash loadtest/gpu_session.sh kernels   # Triton kernel benchmark (decode: split vs unsplit vs torch)
#   bash loadtest/gpu_session.sh kernel-tests  # the kernel tests alone, natively (split-KV + graphs)
#   bash loadtest/gpu_session.sh kernel-sweep [KNOB ...]  # launch-knob sweep for Hopper tuning
#   bash loadtest/gpu_session.sh A         # docs/benchmarks.md workload A (Qwen3-0.6B shape)
#   bash loadtest/gpu_session.sh B         # workload B (Llama-3.1-8B shape)
#   bash loadtest/gpu_session.sh smoke     # A, 32 short requests: checks every peer runs
#   bash loadtest/gpu_session.sh overlap   # issue 9: A with and without overlapped scheduling
#   bash loadtest/gpu_session.sh guided    # issue 9: schema-constrained vs plain, 32 and 256 requests
#   bash loadtest/gpu_session.sh profile   # issue 9: GPU busy share of a steady decode step, overlap off/on
#   bash loadtest/gpu_session.sh overhead  # issue 8: engine vs AsyncLLM vs the Serve app, stream intervals
#                                          # (needs Ray, FastAPI on PYTHONPATH: gpu_wheels.sh)
#   bash loadtest/gpu_session.sh serving   # issue 8's shape: 256 requests 512 in / 256 out at concurrency 256,
#                                          # served (three stream budgets) vs AsyncLLM vs offline
#   bash loadtest/gpu_session.sh serving-ingress2  # the same, served with two Ingress replicas: does
#                                          # admission (TTFT at 256 streams) halve?
#   bash loadtest/gpu_session.sh serving-colocated  # the same, the Ingress running its engine
#                                          # (colocate_ingress): one GIL for both, or faster?
#   bash loadtest/gpu_session.sh batch     # issue 13: the batch job vs LLM.generate, Qwen3-0.6B shape
#   bash loadtest/gpu_session.sh engine-tests  # the CUDA engine tests alone (greedy vs HF, graphs, bf16)
#   bash loadtest/gpu_session.sh model-tests   # issue 33 natively: MoE (Triton grouped GEMMs), Gemma,
#                                          # gpt-oss, sliding windows / soft-caps / sinks, two KV groups in graphs
#   bash loadtest/gpu_session.sh kv-fp8    # issue 34: the fp8 KV cache's tests natively (sm_89+), then decode
#                                          # throughput, bf16 cache vs fp8, Qwen3-0.6B shape, 256 x 512 in / 256 out
#   bash loadtest/gpu_session.sh lora      # issue 35: the LoRA tests natively (Triton shrink / expand, the engine
#                                          # with adapters eager and in CUDA graphs), then loadtest.lora_bench
#                                          # (the engine tests write adapters with peft: gpu_wheels.sh's site)
#   bash loadtest/gpu_session.sh kv-offload  # issue 37: the host KV tier's tests natively (copies on their own
#                                          # stream, registered host memory), then loadtest.kv_offload_bench
#                                          # (copy GB/s out and in, against the PCIe limit); passing it is what
#                                          # turns DEFAULT_CUDA_KV_OFFLOAD_GB (engine/config/engine.py) on
#   bash loadtest/gpu_session.sh quant     # issue 34: the quantized-weight tests natively (Triton FP8 block,
#                                          # int4 and GGUF GEMMs, _scaled_mm, _int_mm), then workload B's shape
#                                          # (Llama-3.1-8B) bf16 vs online FP8 weights, decode tok/s and roofline
#   bash loadtest/gpu_session.sh spec      # issue 36: speculation's CUDA tests (overlapped, graphs for plain
#                                          # steps), then n-gram against none, Qwen3-0.6B shape, at 1 and 64
#                                          # requests in flight, overlapped (the CUDA default) and not
# The device image has torch, triton, transformers and pytest but no Ray, xgrammar or
# jsonschema: `bash loadtest/gpu_wheels.sh` here packs them into .whl/site.tar.xz; carry it and
# start the device command with `mkdir -p /tmp/site && tar xJf .whl/site.tar.xz -C /tmp/site &&
# export PYTHONPATH=/tmp/site:$PWD`, or the serve and batch stages fail and the guided tests skip.
# Logs and JSON go to $OUT (or bench_out/gpu).
set -uo pipefail
stage=${1:-tests}
out=${OUT:-bench_out/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || true
QWEN3=/tmp/qwen3-0.6b
qwen3_model() {  # the Qwen3-0.6B-shape checkpoint, built once per machine
  [ -d "$QWEN3" ] || python3 -m engine.tools.tiny_model --out "$QWEN3" --preset qwen3-0.6b
}
serving() {  # NAME EXTRA_ARGS...: issue 8's shape, served vs AsyncLLM vs offline
  local name=$1; shift
  qwen3_model
  python3 -m loadtest.overhead --device cuda --model "$QWEN3" --concurrency 256 --num-requests 256 \
    --input-len 512 --output-len 256 --max-model-len 1024 --paths serve,offline,async \
    --metrics-interval-ms 1000 "$@" --out "$out/$name.json" 2>&1 | tee "$out/$name.log"
}
case "$stage" in
  tests)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      tests/test_kernels_attention.py tests/test_kernels_attention_split.py tests/test_kernels_store_kv.py \
      tests/test_kernels_validation.py tests/test_models.py tests/test_llm.py tests/test_llm_engine.py \
      tests/test_sampler.py tests/test_structured_output.py tests/test_kernels_lora.py tests/test_lora.py \
      -k "cuda or triton or gpu or guided or kernels or models" \
      2>&1 | tee "$out/gpu_tests.log" ;;
  kernels)
    python3 -m loadtest.kernel_bench --out "$out/kernel_bench.json" 2>&1 | tee "$out/kernel_bench.log" ;;
  kernel-tests)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_attention.py \
      tests/test_kernels_attention_split.py tests/test_kernels_store_kv.py tests/test_kernels_validation.py \
      tests/test_kernels_fp8_kv.py tests/test_kernels_lora.py 2>&1 | tee "$out/kernel_tests.log" ;;
  kernel-sweep)
    # All knobs take ~minutes of compiles; name a few (e.g. NUM_SPLITS KV_TILE) to stay in one command.
    shift
    python3 -m loadtest.kernel_bench --out "$out/kernel_sweep.json" --sweep "$@" \
      2>&1 | tee "$out/kernel_sweep.log" ;;
  A|B)
    python3 -m loadtest.gpu_bench --workload "$stage" --out "$out/gpu_bench_$stage.json" \
      2>&1 | tee "$out/gpu_bench_$stage.log" ;;
  smoke)
    python3 -m loadtest.gpu_bench --workload A --quick --peer-timeout 120 --out "$out/gpu_bench_smoke.json" \
      2>&1 | tee "$out/gpu_bench_smoke.log" ;;
  overlap)
    python3 -m loadtest.gpu_bench --workload A --peers ours,ours_sync --out "$out/gpu_bench_overlap.json" \
      2>&1 | tee "$out/gpu_bench_overlap.log" ;;
  guided)
    qwen3_model
    for n in 32 256; do
      python3 -m loadtest.guided_bench --device cuda --model "$QWEN3" --num-requests $n \
        --out "$out/guided_bench_$n.json" 2>&1 | tee "$out/guided_bench_$n.log"
    done ;;
  profile)
    qwen3_model
    python3 -m loadtest.step_profile --device cuda --model "$QWEN3" --num-seqs 256 --prompt-len 512 \
      --out "$out/step_profile.json" 2>&1 | tee "$out/step_profile.log" ;;
  overhead)
    # The Serve path runs first: its replica is a separate process, so the driver's engines
    # that follow find the GPU memory free again.
    qwen3_model
    python3 -m loadtest.overhead --device cuda --model "$QWEN3" --concurrency 256 --num-requests 512 \
      --input-len 512 --output-len 256 --max-model-len 1024 --paths serve,offline,async --stream-interval-ms 0,50,100 \
      --out "$out/overhead_gpu.json" 2>&1 | tee "$out/overhead_gpu.log" ;;
  serving)
    serving serving_gpu --num-ttft-requests 4 --sweep max_stream_messages_per_s=2000,1000,4000 ;;
  serving-ingress2)
    serving serving_ingress2 --num-ttft-requests 8 --serve-arg ingress_replicas=2 ;;
  serving-colocated)
    serving serving_colocated --num-ttft-requests 8 --serve-arg colocate_ingress=true ;;
  batch)
    qwen3_model
    python3 -m loadtest.batch_bench --device cuda --model "$QWEN3" --num-rows 2048 --max-tokens 128 \
      --out "$out/batch_gpu.json" 2>&1 | tee "$out/batch_gpu.log" ;;
  model-tests)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_moe.py tests/test_kernels_fused_moe.py \
      tests/test_kernels_fused_moe_swiglu.py tests/test_gemma.py tests/test_gpt_oss.py tests/test_sliding_window.py \
      tests/test_phi3.py tests/test_rotary.py tests/test_kernels_attention.py tests/test_kernels_attention_split.py \
      2>&1 | tee "$out/model_tests.log" ;;
  kv-fp8)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_fp8_kv.py tests/test_kv_cache_fp8.py \
      2>&1 | tee "$out/kv_fp8_tests.log"
    qwen3_model
    python3 -m loadtest.quant_bench --device cuda --model "$QWEN3" --num-seqs 256 --prompt-len 512 \
      --output-len 256 --kv-cache-dtypes auto,fp8 --out "$out/kv_dtype_bench.json" 2>&1 | tee "$out/kv_dtype_bench.log" ;;
  lora)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_lora.py tests/test_layers_lora.py \
      tests/test_lora.py tests/test_config.py -k "lora" 2>&1 | tee "$out/lora_tests.log"
    python3 -m loadtest.lora_bench --out "$out/lora_bench.json" 2>&1 | tee "$out/lora_bench.log" ;;
  kv-offload)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kv_offload.py tests/test_priority_scheduling.py \
      2>&1 | tee "$out/kv_offload_tests.log"
    python3 -m loadtest.kv_offload_bench --device cuda --out "$out/kv_offload_bench.json" 2>&1 | tee "$out/kv_offload_bench.log" ;;
  quant)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_fp8_gemm.py tests/test_kernels_int4_gemm.py \
      tests/test_kernels_gguf.py tests/test_quantization.py tests/test_quantization_fp8.py tests/test_quantization_int8.py \
      tests/test_quantization_int4.py tests/test_quantization_gguf.py 2>&1 | tee "$out/quant_tests.log"
    [ -d /tmp/llama-8b ] || python3 -m engine.tools.tiny_model --out /tmp/llama-8b --preset llama-8b
    python3 -m loadtest.quant_bench --device cuda --model /tmp/llama-8b --num-seqs 64 --prompt-len 512 \
      --output-len 256 --quantizations none,fp8 --out "$out/quant_bench.json" 2>&1 | tee "$out/quant_bench.log" ;;
  spec)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_spec_decode_overlap.py -k cuda \
      2>&1 | tee "$out/spec_tests.log"
    qwen3_model
    for overlap in auto off; do
      python3 -m loadtest.offline --speculative ngram --device cuda --dtype bfloat16 --model "$QWEN3" \
        --concurrency 1,64 --num-requests 32 --async-scheduling $overlap --out "$out/offline_spec_$overlap.json" \
        2>&1 | tee "$out/offline_spec_$overlap.log"
    done ;;
  engine-tests)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" -x tests/test_llm.py tests/test_llm_engine.py \
      tests/test_kernels_attention_split.py -k "cuda or gpu or triton" 2>&1 | tee "$out/engine_tests.log" ;;
  *) echo "unknown stage $stage (tests|kernels|kernel-tests|kernel-sweep|A|B|smoke|overlap|guided|profile|overhead|serving|serving-ingress2|batch|engine-tests|model-tests|kv-fp8|lora|kv-offload|quant|spec)"
     exit 2 ;;
esac
