set -u
mkdir -p bin && cp target/release/kiln bin/kiln   # the release build of the commit measured
s=$(date +%s)
W=/tmp/kf; mkdir -p $W
python3 -c "import sys; sys.path.insert(0, 'bench'); import llama_parity as p; p.save(p.configs()[1][1], '$W/smol', '.gpufa/tok')" >/dev/null 2>&1
zcat data/shakespeare.txt.gz > "$W/corpus.txt"
python3 bench/shakespeare_chat.py "$W/corpus.txt" "$W/chat.jsonl" 2000
bin/kiln finetune --init-from "$W/smol" --data "$W/chat.jsonl" --out "$W/ft" --device cuda -q train.precision=fp32 train.seq_len=256 train.micro_batch=8 train.steps=30 train.eval_every=0 optim.lr=5e-3 optim.warmup_steps=2 2>&1 | tail -3
bin/kiln export --run "$W/ft" --to "$W/merged" 2>&1 | tail -1
python3 -c "
import json
for p in ['The king is dead', 'What say you, my lord?']:
    print(json.dumps({'prompt': p}))" > "$W/prompts.jsonl"
bin/kiln generate --run "$W/ft" --prompts "$W/prompts.jsonl" --out "$W/replies.jsonl" --temperature 0 --tokens 32 --precision fp32 2>&1 | tail -1
python3 bench/peft_parity.py --base "$W/smol" --run "$W/ft" --merged "$W/merged" --replies "$W/replies.jsonl"
echo "t=$(( $(date +%s)-s ))"
