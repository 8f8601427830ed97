"""PEFT loads kiln's adapters: a kiln LoRA fine-tune of a random SmolLM2-shaped model is
loaded by peft onto the same base in transformers (fp32), and its log-probabilities along
fixed token ids are compared with those of kiln's merged export and of kiln's own greedy
decoding of the run.

    python3 bench/peft_parity.py --base DIR --run RUN --merged DIR
"""

import argparse
import json

import peft
import torch
import transformers as tf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--replies", help="kiln generate --out JSON lines of the run (greedy)")
    a = ap.parse_args()
    torch.manual_seed(0)
    base = tf.AutoModelForCausalLM.from_pretrained(a.base, torch_dtype=torch.float32).cuda()
    ids = torch.randint(0, base.config.vocab_size, (2, 96), device="cuda")
    with torch.no_grad():
        plain = torch.log_softmax(base(ids).logits.float(), -1)
    model = peft.PeftModel.from_pretrained(base, a.run + "/adapter").cuda().eval()
    merged = tf.AutoModelForCausalLM.from_pretrained(a.merged, torch_dtype=torch.float32).cuda()
    with torch.no_grad():
        lp_peft = torch.log_softmax(model(ids).logits.float(), -1)
        lp_merged = torch.log_softmax(merged(ids).logits.float(), -1)
    diff = (lp_peft - lp_merged).abs().max().item()
    moved = (lp_peft - plain).abs().max().item()
    ok = diff < 1e-3 and moved > 10 * diff
    print(json.dumps({"check": "peft adapter vs kiln merged export", "max_logprob_diff": diff,
                      "adapter_effect": moved, "pass": ok}))
    if a.replies:
        agree, total = 0, 0
        for line in open(a.replies):
            r = json.loads(line)
            prompt = torch.tensor([r["prompt_tokens"]], device="cuda")
            kiln_new = r["samples"][0]["tokens"] if "samples" in r else r["tokens"]
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=len(kiln_new), do_sample=False,
                                     attention_mask=torch.ones_like(prompt))
            hf_new = out[0, prompt.shape[1]:].tolist()
            n = next((i for i, (x, y) in enumerate(zip(hf_new, kiln_new)) if x != y),
                     min(len(hf_new), len(kiln_new)))
            agree += n
            total += len(kiln_new)
        print(json.dumps({"check": "kiln greedy (run with adapters) vs peft greedy",
                          "tokens_agreeing_before_divergence": agree, "tokens": total,
                          "pass": agree == total}))


if __name__ == "__main__":
    main()
