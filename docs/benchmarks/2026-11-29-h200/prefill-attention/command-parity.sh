#!/usr/bin/env bash
# fp32 greedy against transformers (bench/llama_parity.py) with prompts of 26 to 40 tokens,
# long enough that their prefill takes the packed path (PREFILL_FLASH_FROM = 16).
set -u
PYTHONUNBUFFERED=1 timeout 300 python3 -c "
import sys; sys.path.insert(0,'bench'); import llama_parity as p
base = ['The history of the city begins with a small settlement on the river, where traders from the north and the south met to exchange salt, grain and cloth. Over the centuries ', 'def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that large inputs do not overflow the stack.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n', 'Question: what is 17 times 23? Think step by step, writing every partial product on its own line, and then state the final answer clearly. Answer:']
p.PROMPTS = base
sys.argv = ['llama_parity.py', '--kiln', '/tmp/kiln-prefill', '--tokenizer', 'gpubin/tok', '--work', '/tmp/pl', '--only', sys.argv[1]]
p.main()
" smollm2-135m 2>&1 | grep -E "^\||rror|Trace" | tee $OUT/parity-smollm2-long.txt
PYTHONUNBUFFERED=1 timeout 250 python3 -c "
import sys; sys.path.insert(0,'bench'); import llama_parity as p
p.PROMPTS = ['The history of the city begins with a small settlement on the river, where traders from the north and the south met to exchange salt, grain and cloth. Over the centuries ', 'Question: what is 17 times 23? Think step by step, writing every partial product on its own line, and then state the final answer clearly. Answer:']
sys.argv = ['llama_parity.py', '--kiln', '/tmp/kiln-prefill', '--tokenizer', 'gpubin/tok', '--work', '/tmp/pl2', '--only', 'llama-3.2-1b']
p.main()
" 2>&1 | grep -E "^\||rror|Trace" | tee $OUT/parity-l1b-long.txt
