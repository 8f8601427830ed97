"""The phases of one polychromic step done the way known implementations do them, on one GPU:
replies generated one prompt at a time with Hugging Face `generate` (bf16, SDPA), embedded
with sentence-transformers, and one forward/backward of a PEFT LoRA model (r16 on
q/k/v/o/gate/up/down, bf16 autocast) over the CE batch and the replies with per-reply weights.

    python3 bench/polychromic_hf_baseline.py --model SMOL_HF_DIR --embedder MINILM_DIR \
        --prompts cues.jsonl --prompts-per-step 8 --samples 8 --max-new-tokens 48

Each phase runs once untimed, then --repeats times; the median is reported. Prints one JSON
line: generate_s, embed_s, forward_backward_s, replies, reply_tokens.
"""

import argparse
import json
import statistics
import time

import torch
import transformers as tf


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--embedder", required=True, help="a sentence-transformers directory")
    ap.add_argument("--prompts", required=True, help="JSON lines with a \"prompt\" field")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = tf.AutoTokenizer.from_pretrained(a.model)
    eos = tok.eos_token_id
    pad = eos if eos is not None else 0
    with open(a.prompts) as f:
        prompts = [json.loads(l)["prompt"] for l in f if l.strip()][: a.prompts_per_step]
    gen = tf.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

    def generate():
        replies = []
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids.cuda()
            out = gen.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=a.temperature, top_p=a.top_p, top_k=0,
                max_new_tokens=a.max_new_tokens, num_return_sequences=a.samples,
                eos_token_id=eos, pad_token_id=pad)
            for row in out:
                reply = row[ids.shape[1]:].tolist()
                if eos in reply:
                    reply = reply[: reply.index(eos) + 1]
                replies.append((ids[0].tolist(), reply))
        return replies

    generate_s, replies = timed(generate, a.repeats)
    texts = [tok.decode(r, skip_special_tokens=True) for _, r in replies]
    reply_tokens = sum(len(r) for _, r in replies)
    del gen
    torch.cuda.empty_cache()

    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(a.embedder, device="cuda")
    embed_s, emb = timed(lambda: st.encode(texts, batch_size=64, convert_to_tensor=True), a.repeats)
    # The leave-one-out advantages as kiln computes them, so the weights are realistic.
    u = torch.nn.functional.normalize(emb.float().view(len(prompts), a.samples, -1), dim=-1)
    n = a.samples
    gram = u @ u.transpose(1, 2)
    contrib = 1 - (gram.sum(-1) - 1) / (n - 1)
    d = contrib.mean(-1, keepdim=True)
    adv = (2 * n / (n - 2) * (contrib - d)) if n > 2 else 2 * d.expand(-1, n)
    weights = (0.5 * adv / (n * len(prompts))).flatten()
    del st
    torch.cuda.empty_cache()

    from peft import LoraConfig, get_peft_model
    model = tf.AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.float32, attn_implementation="sdpa").cuda()
    model = get_peft_model(model, LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    vocab = model.config.vocab_size
    ce_ids = torch.randint(0, vocab, (a.micro_batch, a.seq_len + 1), device="cuda")
    longest = max(len(p) + len(r) for p, r in replies)
    rows = torch.full((len(replies), longest), pad, dtype=torch.long)
    labels = torch.full((len(replies), longest), -100, dtype=torch.long)
    for i, (p, r) in enumerate(replies):
        seq = torch.tensor(p + r)
        rows[i, : len(seq)] = seq
        labels[i, len(p): len(seq)] = seq[len(p):]
    rows, labels = rows.cuda(), labels.cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def forward_backward():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ce_ids[:, :-1]).logits.float()
            ce = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), ce_ids[:, 1:].reshape(-1))
            logits = model(input_ids=rows).logits.float()
            token = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                ignore_index=-100, reduction="none").view(len(replies), -1)
            surrogate = (weights[:, None] * token).sum()
        (ce + surrogate).backward()
        return None

    forward_backward_s, _ = timed(forward_backward, a.repeats)
    print(json.dumps({
        "engine": "transformers+sentence-transformers+peft",
        "prompts": len(prompts),
        "replies": len(replies),
        "reply_tokens": reply_tokens,
        "generate_s": generate_s,
        "embed_s": embed_s,
        "forward_backward_s": forward_backward_s,
    }), flush=True)


if __name__ == "__main__":
    main()
