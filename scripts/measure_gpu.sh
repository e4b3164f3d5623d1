#!/usr/bin/env bash
# Every GPU figure of the docs in one run on one GPU, within a wall-clock budget.
#
#   bash scripts/measure_gpu.sh OUT_DIR MNIST_DIR [BUDGET_SECONDS]
#
# With ARCHIVE=FILE.tgz set, OUT_DIR is also packed into that one file after every stage (for hosts
# that hand back a limited number of files).
#
# MNIST_DIR holds the idx files (t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz). Stages, in
# order of importance; each is cut at its own cap and at the budget, writes its log and results to
# OUT_DIR at once, and a failed stage does not stop the next:
#   1. speedrun: seconds from process start to 0.60 non-empty accuracy on val at r=0.5 (eager,
#      batch 256, fixed ratio 0.5, random masks), at three learning rates;
#   2. compute scaling of configs/mnist-gpu.yaml at 1x/4x/16x/64x a base budget (scripts/compute_scaling.py),
#      at the learning rate that reached the target first in stage 1, each run a process of its own;
#      then at 1x and 16x compiled with CUDA graphs (reduce-overhead), for comparison;
#   3. the step against the plain block stack at the large size, static against masked (benchmark.py);
#   4. configs/mnist.yaml at batch 16, compiled, default against reduce-overhead;
#   5. torchrun with nccl (one process per GPU), a few steps;
#   6. a packed MNIST, trained from the memory map (data.on_device=false) and from device memory.
set -u
OUT=${1:?OUT_DIR}
MNIST=${2:?MNIST_DIR}
BUDGET=${3:-570}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export TQDM_DISABLE=1
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu and EXTRA="--set ..." (smaller models) try the script on a CPU
EXTRA=${EXTRA:-}
IDX="--set data.source=idx --set data.path=$MNIST $EXTRA"

left() { echo $((BUDGET - SECONDS)); }
# stage NAME CAP_SECONDS COMMAND...: run COMMAND under min(CAP, what is left), log to OUT/NAME.log
stage() {
    local name=$1 cap=$2; shift 2
    local t=$(left)
    [ "$cap" -lt "$t" ] && t=$cap
    if [ "$t" -le 5 ]; then echo "[$SECONDS s] skip $name: budget spent" | tee -a "$OUT/stages.log"; return; fi
    echo "[$SECONDS s] start $name (cap $t s)" | tee -a "$OUT/stages.log"
    timeout -k 5 "$t" "$@" >"$OUT/$name.log" 2>&1
    echo "[$SECONDS s] end $name: exit $?" | tee -a "$OUT/stages.log"
    [ -n "${ARCHIVE:-}" ] && tar czf "$ARCHIVE" -C "$OUT" .
}

stage env 60 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv;
    python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())";
    nproc; python3 -m pip install -q --no-deps --no-build-isolation -e . || true'

# 1. speedrun
SPEED="--device $DEVICE --budget 24 --eval-every 1 --target 0.60 --set train.compile=false
  --set train.precision=bf16 --set mask.ratio_schedule=fixed --set mask.strategy=random
  --set train.max_steps=3000 --set train.warmup_steps=100 --set train.ema_decay=0"
for lr in 0.0025 0.005 0.01; do
    stage "speedrun-lr$lr" 40 python3 scripts/speedrun.py --config configs/mnist-gpu.yaml $IDX $SPEED \
        --set train.lr=$lr --curve "$OUT/speedrun-lr$lr.csv"
done
BEST_LR=$(python3 - "$OUT" <<'EOF'
import csv, glob, sys
best = (float("inf"), -1.0, "0.005")
for path in glob.glob(f"{sys.argv[1]}/speedrun-lr*.csv"):
    rows = list(csv.DictReader(open(path)))
    if not rows:
        continue
    lr = path.rsplit("-lr", 1)[1][:-4]
    hit = [float(r["seconds"]) for r in rows if float(r["acc_nonempty"]) >= 0.60]
    key = (min(hit) if hit else float("inf"), -max(float(r["acc_nonempty"]) for r in rows), lr)
    best = min(best, key)
print(best[2])
EOF
)
echo "[$SECONDS s] learning rate for the scaling runs: $BEST_LR" | tee -a "$OUT/stages.log"

# 2. compute scaling (the deadlines leave about 240 s for the stages after it)
DEADLINE=$(( $(left) - 330 ))
stage scaling $(( DEADLINE + 20 )) python3 scripts/compute_scaling.py --config configs/mnist-gpu.yaml $IDX \
    --set train.lr=$BEST_LR --device $DEVICE --base-seconds 1.5 --deadline $DEADLINE \
    --out "$OUT/scaling.jsonl" --save-dir /tmp/vitmask-gpu/scaling
DEADLINE=$(( $(left) - 240 ))
stage scaling-cuda-graphs $(( DEADLINE + 20 )) python3 scripts/compute_scaling.py --config configs/mnist-gpu.yaml \
    $IDX --set train.lr=$BEST_LR --set train.compile=true --set train.compile_mode=reduce-overhead \
    --device $DEVICE --base-seconds 1.5 --multipliers 1,16 --deadline $DEADLINE \
    --out "$OUT/scaling-cuda-graphs.jsonl" --save-dir /tmp/vitmask-gpu/scaling-cuda-graphs

# 3. the large step against the plain block stack
stage bench-large 110 python3 scripts/benchmark.py --device $DEVICE --autocast bf16 --compile --batch 1024 \
    --steps 20 --warmup 5 --set model.hidden_dim=512 --set model.depth=8 --set model.num_heads=8 \
    --set model.ffn_dim=2048 --ref-autocast same --ref-compile --vs compile=1,train.step_shapes=masked \
    --mask-timing 16,1024 --json "$OUT/bench-large.json"

# 4. configs/mnist.yaml at batch 16
stage bench-mnist 60 python3 scripts/benchmark.py --device $DEVICE --config configs/mnist.yaml --batch 16 \
    --steps 200 --warmup 20 $IDX --no-reference --vs train.compile_mode=reduce-overhead \
    --json "$OUT/bench-mnist.json"

# 5. torchrun with nccl, every GPU of the machine
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$GPUS" -ge 1 ] || GPUS=1
stage ddp 40 torchrun --standalone --nproc_per_node "$GPUS" -m vitmask train --config configs/mnist-gpu.yaml \
    $IDX --set train.max_steps=60 --set train.eval_every=30 --set train.checkpoint_every=60 \
    --set train.log_every=20 --device $DEVICE --run-dir /tmp/vitmask-gpu/ddp

# 6. packed data on the GPU
rm -rf /tmp/vitmask-gpu/mnist-packed
stage pack 20 python3 -m vitmask pack --config configs/mnist-gpu.yaml $IDX --out /tmp/vitmask-gpu/mnist-packed
for place in false true; do
    stage "packed-on-device-$place" 25 python3 -m vitmask train --config configs/mnist-gpu.yaml \
        --set data.source=packed --set data.path=/tmp/vitmask-gpu/mnist-packed $EXTRA --set data.on_device=$place \
        --set train.compile=false --set train.max_steps=40 --set train.eval_every=40 --set train.log_every=20 \
        --set train.checkpoint_every=40 --device $DEVICE --run-dir /tmp/vitmask-gpu/packed-$place
done
echo "[$SECONDS s] done" | tee -a "$OUT/stages.log"
[ -n "${ARCHIVE:-}" ] && tar czf "$ARCHIVE" -C "$OUT" .
