#!/usr/bin/env bash
# One training step of kiln and of PyTorch + torch.compile under Nsight Compute, the same tool
# and settings for both (one metric, caches and clocks as in a run), grouped by kind of work:
# GPT-2 small bf16-mixed 16 x 1024 (bench/pytorch_gpt.py, padded vocabulary) and the
# Llama-3.2-1B shape bf16 8 x 1024 (bench/hf_llama_train.py, transformers + torch.compile).
# Wall tokens/s of both engines first, in the same command.
set -u
R=/tmp/r; mkdir -p $R
s=$(date +%s)
xz -dc gpubin/kiln-head.xz > /tmp/kiln && chmod +x /tmp/kiln
K=/tmp/kiln
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
NCU=$(which ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
NC="$NCU --profile-from-start off --cache-control none --clock-control none --metrics gpu__time_duration.sum --csv"
common="train.precision=bf16-mixed train.seq_len=1024 train.eval_every=0 train.checkpoint_every=0 train.log_every=1 optim.warmup_steps=5 train.save_final=false"
GPT2="model.d_model=768 model.n_layers=12 model.n_heads=12 model.context=1024 data.tokenizer=gpt2 train.micro_batch=16"
L1B="model.kind=llama model.vocab=128256 model.d_model=2048 model.n_layers=16 model.n_heads=32 model.n_kv_heads=8 model.head_dim=64 model.ffn_hidden=8192 model.context=1024 model.rope_theta=500000.0 model.rot_dim=64 model.tied_head=true data.tokenizer=gpt2 train.micro_batch=8"
med() { python3 -c "
import json,statistics; r=[json.loads(l) for l in open('$1/metrics.jsonl')]; t=[x for x in r if x.get('kind')=='train' and x['step']>$3]
m=statistics.median(x['tokens_per_s'] for x in t); print('$2 kiln median tokens/s', round(m), 'ms/step', round($4e3/m,2))"; }
# GPT-2 small: wall, then one step each under ncu.
timeout 90 $K train --device cuda --out $R/g-wall -q --profile none $common $GPT2 train.steps=30 > $R/g-wall.log 2>&1; echo "g wall rc $? t=$(( $(date +%s)-s ))"; med $R/g-wall gpt2 10 16384
timeout 200 python3 bench/pytorch_gpt.py --batch 16 --modes bf16-compile --steps 10 > $R/g-torch.json 2>$R/g-torch.err; echo "g torch rc $? t=$(( $(date +%s)-s ))"
python3 -c "import json; r=json.load(open('$R/g-torch.json')); print('gpt2 compile tokens/s', round(r['tokens_per_s']), 'ms/step', round(r['step_ms'],2))"
timeout 150 $NC $K train --device cuda --out $R/g-ncu -q --profile none $common $GPT2 train.steps=4 --profile-steps 3..=3 > $R/kiln-gpt2.csv 2>/dev/null; echo "g kiln ncu rc $? t=$(( $(date +%s)-s ))"
timeout 240 $NC python3 bench/pytorch_gpt.py --batch 16 --modes bf16-compile --steps 2 --warmup 5 --profile-step 6 > $R/compile-gpt2.csv 2>$R/g-ncu-torch.err; echo "g torch ncu rc $? t=$(( $(date +%s)-s ))"
python3 bench/ncu_step_compare.py kiln=$R/kiln-gpt2.csv compile=$R/compile-gpt2.csv --top 40 > $R/gpt2-split.txt; head -14 $R/gpt2-split.txt
# Llama-3.2-1B shape: kiln wall and one step under ncu, then transformers + torch.compile.
timeout 120 $K train --device cuda --out $R/l-wall -q --profile none $common $L1B train.steps=16 > $R/l-wall.log 2>&1; echo "l wall rc $? t=$(( $(date +%s)-s ))"; med $R/l-wall llama1b 5 8192
timeout 150 $NC $K train --device cuda --out $R/l-ncu -q --profile none $common $L1B train.steps=4 --profile-steps 3..=3 > $R/kiln-l1b.csv 2>/dev/null; echo "l kiln ncu rc $? t=$(( $(date +%s)-s ))"
timeout 300 $NC python3 bench/hf_llama_train.py --shape llama-3.2-1b --batch 8 --seq 1024 --compile --steps 2 --warmup 3 --profile-step 4 > $R/compile-l1b.csv 2>$R/l-ncu-torch.err; echo "l torch ncu rc $? t=$(( $(date +%s)-s ))"
grep -h '^{' $R/compile-l1b.csv | python3 -c "import json,sys; [print('llama1b compile (under ncu, steps other than the profiled one)', json.loads(l)['tokens_per_s']) for l in sys.stdin]"
python3 bench/ncu_step_compare.py kiln=$R/kiln-l1b.csv compile=$R/compile-l1b.csv --top 40 > $R/l1b-split.txt; head -14 $R/l1b-split.txt
gzip -f $R/*.csv
tar czf $OUT/logs.tgz -C $R --exclude='*/checkpoints' . 2>/dev/null
cp $R/*split.txt $OUT/ 2>/dev/null
echo "done t=$(( $(date +%s)-s ))"
