#!/usr/bin/env bash
# Data-parallel checks on the GPUs of one machine, GPT-2 small (124M, bf16-mixed, 1024 tokens,
# micro-batch 8 per GPU) on the bundled corpus:
#  1. `--gpus 1` through the whole NCCL path (communicator, buckets, ZeRO-0/1/2 with a world
#     of one) against the plain single-GPU path: losses per step and the overhead in tokens/s.
#  2. With 2+ GPUs: `--gpus N` against one GPU accumulating the same global batch (losses),
#     tokens/s per GPU beside PyTorch DDP (torchrun, the same model script as `kiln bench
#     train`, bf16 autocast with and without torch.compile), ZeRO-1/2 memory per rank, a
#     Llama-3.2-1B-shaped model under ZeRO-0/1/2 with its plan, and a run stopped by SIGTERM on
#     the most GPUs resumed on half as many.
#  3. A one-step trace at every GPU count, summarised by bench/dist_trace.py (collective time,
#     how much of it lies under compute, when the first bucket leaves).
# PARTS picks sections (default all): "one" is 1, "multi" is 2 and 3 for GPT-2 small, "torch"
# is PyTorch DDP on GPT-2 small at every GPU count, "resume" the stop on the most GPUs and the
# resume on half as many, "llama" the Llama shape (ZeRO-0/1/2, planned and measured memory),
# "torch-llama" transformers' Llama under DDP and ZeRO-1 on the same shape.
# Usage: KILN=bin/kiln OUT=/tmp/d STEPS=100 [PARTS=gpt] bench/dist_gpu_check.sh
set -u
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-dist-check}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
NGPU=$(nvidia-smi -L | wc -l)
echo "GPUs: $NGPU"; nvidia-smi -L
# GPT-2 small's learning rate (6e-4, as nanoGPT): kiln's default of 3e-3 suits its small
# default model, and on 124M parameters it makes the loss spike, so runs that differ only in
# the order of gradient additions part ways and the per-step comparison measures chaos.
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=8 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=2 optim.warmup_steps=10 optim.lr=${LR:-6e-4} optim.min_lr=6e-5 train.steps=$STEPS"
T() {
  echo "== $*"; local s; s=$(date +%s.%N)
  "$@" > "$OUT/last.log" 2>&1; local rc=$?
  echo "   exit $rc, wall $(python3 -c "print(round($(date +%s.%N) - $s, 1))") s"; tail -n 3 "$OUT/last.log"; return $rc
}

PARTS=${PARTS:-one multi torch resume llama torch-llama}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
COUNTS="2 $( [ "$NGPU" -ge 4 ] && echo 4 )"
[ "$NGPU" -ge 2 ] || COUNTS=""
MAXN=$( [ "$NGPU" -ge 4 ] && echo 4 || echo 2 ); HALF=$(( MAXN / 2 ))

if has one; then
# 1. One GPU: plain path and the NCCL path with a world of one.
T $KILN train --profile none -q --out "$OUT/plain" $GPT2 train.grad_accum=1
T $KILN train --profile none -q --gpus 1 --out "$OUT/g1" $GPT2 train.grad_accum=1 --trace "$OUT/trace_g1.json" --trace-steps 20..=21
T $KILN train --profile none -q --gpus 1 --out "$OUT/g1z1" $GPT2 train.grad_accum=1 dist.zero=1
T $KILN train --profile none -q --gpus 1 --out "$OUT/g1z2" $GPT2 train.grad_accum=1 dist.zero=2
python3 bench/dist_compare.py "$OUT/plain" "$OUT/g1" "$OUT/g1z1" "$OUT/g1z2" --bound 0.01 | tee "$OUT/one_gpu.txt"
fi

if has multi; then

for N in $COUNTS; do
  T $KILN train --profile none -q --out "$OUT/acc$N" $GPT2 train.grad_accum=$N
  T $KILN train --profile none -q --gpus $N --out "$OUT/g$N" $GPT2 train.grad_accum=1 --trace "$OUT/trace_g$N.json" --trace-steps 20..=21
  T $KILN train --profile none -q --gpus $N --out "$OUT/g${N}z1" $GPT2 train.grad_accum=1 dist.zero=1
  T $KILN train --profile none -q --gpus $N --out "$OUT/g${N}z2" $GPT2 train.grad_accum=1 dist.zero=2
  python3 bench/dist_compare.py "$OUT/acc$N" "$OUT/g$N" "$OUT/g${N}z1" "$OUT/g${N}z2" --bound 0.01 | tee "$OUT/gpus$N.txt"
done
echo "== traces"
python3 bench/dist_trace.py "$OUT"/trace_g*.json | tee "$OUT/traces.txt"
fi

if has torch; then
for N in 1 $COUNTS; do
  echo "== PyTorch DDP on $N GPU(s)"
  torchrun --standalone --nproc-per-node $N bench/pytorch_gpt.py --batch 8 --seq 1024 --modes bf16,bf16-compile --steps 20 --warmup 5 2> "$OUT/torch$N.err" | tee "$OUT/torch$N.jsonl" | python3 -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if k != 'losses'}) for l in sys.stdin]"
done
fi

if has resume && [ -n "$COUNTS" ]; then
  # Stop MAXN ranks with SIGTERM mid-way, resume on half as many GPUs with the same global
  # batch (train.global_batch stays; each rank's accumulation doubles).
  GB=$(( 8 * MAXN ))
  T $KILN train --profile none -q --out "$OUT/ref$MAXN" $GPT2 train.grad_accum=$MAXN
  $KILN train --profile none -q --gpus $MAXN --out "$OUT/stop" $GPT2 train.global_batch=$GB train.checkpoint_every=20 dist.zero=1 > "$OUT/stop.log" 2>&1 &
  pid=$!
  for i in $(seq 1 900); do [ -d "$OUT/stop/checkpoints/step_0000040" ] && break; sleep 0.1; done
  kill -TERM $pid; wait $pid; echo "stopped $MAXN ranks: exit $? (75 = stopped with a checkpoint)"; tail -n 3 "$OUT/stop.log"
  if [ "$HALF" -ge 2 ]; then
    T $KILN train --profile none -q --gpus $HALF --resume "$OUT/stop"
  else
    T $KILN train --profile none -q --resume "$OUT/stop"
  fi
  python3 bench/dist_compare.py "$OUT/ref$MAXN" "$OUT/stop" --bound 0.01 | tee "$OUT/resume.txt"
  $KILN verify "$OUT/stop" | tail -n 2
fi

if has llama && [ -n "$COUNTS" ]; then
  # Llama-3.2-1B's blocks (width 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) with GPT-2's
  # vocabulary, micro-batch 4 x 1024 per GPU: per-rank memory and tokens/s under ZeRO-0/1/2,
  # at the GPU counts in LLAMA_COUNTS (default: every count) and ZeRO stages in LLAMA_ZEROS
  # (default: 0 1 2). Learning rate 3e-4, as for
  # Llama-3.2-1B (the default 3e-3 makes the loss spike here too). No final checkpoint
  # (14 GB of weights and moments that nothing reads).
  LLAMA="model.kind=llama model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.rope_theta=500000 model.context=1024 train.seq_len=1024 data.tokenizer=gpt2 train.precision=bf16-mixed train.micro_batch=4 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 train.eval_batches=2 optim.warmup_steps=5 optim.lr=3e-4 optim.min_lr=3e-5 train.steps=30 train.save_final=false"
  T $KILN train --profile none -q --out "$OUT/llama1" $LLAMA train.grad_accum=$MAXN
  $KILN plan --profile none $LLAMA train.grad_accum=$MAXN > "$OUT/llama_plan1.txt" 2>&1; tail -n 2 "$OUT/llama_plan1.txt"
  for N in ${LLAMA_COUNTS:-$COUNTS}; do
    for Z in ${LLAMA_ZEROS:-0 1 2}; do
      $KILN plan --profile none --gpus $N $LLAMA train.grad_accum=$(( MAXN / N )) dist.zero=$Z > "$OUT/llama_plan${N}z$Z.txt" 2>&1; tail -n 2 "$OUT/llama_plan${N}z$Z.txt"
      T $KILN train --profile none -q --gpus $N --out "$OUT/llama${N}z$Z" $LLAMA train.grad_accum=$(( MAXN / N )) dist.zero=$Z
    done
    runs=(); for Z in ${LLAMA_ZEROS:-0 1 2}; do runs+=("$OUT/llama${N}z$Z"); done
    python3 bench/dist_compare.py "$OUT/llama1" "${runs[@]}" --bound 0.02 | tee "$OUT/llama$N.txt"
  done
fi

if has torch-llama && [ -n "$COUNTS" ]; then
  for N in 1 $MAXN; do
    for Z in "" "--zero1"; do
      [ "$N" = 1 ] && [ -n "$Z" ] && continue
      echo "== PyTorch (transformers Llama, DDP $Z) on $N GPU(s)"
      torchrun --standalone --nproc-per-node $N bench/hf_llama_train.py --shape llama-3.2-1b --vocab 50257 --batch 4 --seq 1024 --steps 10 --warmup 3 $Z 2> "$OUT/torch_llama$N$Z.err" | tee "$OUT/torch_llama$N$Z.jsonl" | python3 -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if k != 'losses'}) for l in sys.stdin]"
    done
  done
fi
