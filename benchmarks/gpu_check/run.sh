#!/usr/bin/env bash
# Run on the lent GPU machine (device tool: carry [".whl"], command `bash benchmarks/gpu_check/run.sh`), after
# pack.sh here. Installs the carried packages, then runs the GPU tests: the engines on CUDA against the CPU
# (tests/test_gpu.py) and a Ray run with GPU DeviceWorkers against the CPU reference (tests/test_runtime.py -k gpu);
# then the sharded trainers at a real width, the user's command end to end, start-up against the reference, and vLLM
# where the image has it.
set -uo pipefail
out=${OUT:-/tmp}
mkdir -p /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
tar -xJf .whl/ray-slim.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_check.log"
python3 -c "import torch, ray, diffusers; print('torch', torch.__version__, 'ray', ray.__version__, 'diffusers', diffusers.__version__)" | tee -a "$out/gpu_check.log"
python3 -m pytest -q -rs tests/test_gpu.py "tests/test_runtime.py::test_gpu_devices_train_where_the_cpu_reference_goes" 2>&1 | tee -a "$out/gpu_check.log"
status=${PIPESTATUS[0]}
# Sharded trainers (issue 35): FSDP2 on nccl, each kind at a published model's width (Qwen2-0.5B, the SD3-medium
# transformer), a replica in fp32 against FSDP in bf16 with and without activation checkpointing: bytes by kind, peak
# bytes, step time, the full-weight gather of a publication.
timeout 300 python3 benchmarks/gpu_check/sharded.py --json "$out/sharded.json" 2>&1 | tee -a "$out/gpu_check.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
# The user's command end to end on one GPU, each kind of pipeline: the CLI, the Ray runtime, CUDA engines, the summary;
# then each sharded in bf16 with checkpointed activations, and with CPU offload (the runtime's FSDP2 trainer on nccl:
# a group of one here, its lockstep, commit, gathered publication and memory metrics), beside the replicated run's.
for config in sort digits; do
  for sharded in "" "train.sharding=fsdp train.precision=bf16 train.activation_checkpointing=true" \
    "train.sharding=fsdp train.precision=bf16 train.cpu_offload=true"; do
    # shellcheck disable=SC2086  # the overrides are words
    timeout 240 python3 -c "from dovetail.cli import main; main()" train "configs/$config.yaml" \
      --out "/tmp/gpu-$config-${#sharded}" --steps 4 --devices 1 cluster.device=H200 $sharded 2>&1 \
      | tee -a "$out/gpu_check.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    tail -n 1 "/tmp/gpu-$config-${#sharded}/metrics.jsonl" | tee -a "$out/gpu_check.log"
  done
done
# Start-up before the first step where cores are many (issue 19: a Ray run within 4 s of the reference, warm cache;
# on 2 CPU cores the Ray run's extra CPU alone needs 5 s): one round, every arrangement, with each part's CPU-seconds.
timeout 200 python3 benchmarks/startup.py --repeats 1 --out /tmp/gpu-startup -- --devices 1 cluster.device=H200 2>&1 \
  | tee -a "$out/gpu_check.log"
# vLLM (`sampling.engine: vllm`): its CUDA wheel is far over the carry limit, so this step runs only where the image
# has vLLM: the engine tests on the GPU (publication, log-probs, migration, 2 GRPO steps), then the engines' figures.
if python3 -c "import vllm" 2>/dev/null; then
  python3 -c "import vllm; print('vllm', vllm.__version__)" | tee -a "$out/gpu_check.log"
  python3 -m pytest -q -rs -p no:cacheprovider tests/test_vllm_engine.py 2>&1 | tee -a "$out/gpu_check.log"
  vllm_status=${PIPESTATUS[0]}
  python3 benchmarks/rollout_engines.py --repeats 3 2>&1 | tee -a "$out/gpu_check.log"
  [ "$status" -ne 0 ] || status=$vllm_status
else
  echo "vllm: not in this image, the vLLM step skipped" | tee -a "$out/gpu_check.log"
fi
exit "$status"
