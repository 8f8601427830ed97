"""Which semantics transformers' Phi-3 generation follows across LongRoPE's trained context.

Builds phi3_parity.py's small LongRoPE model (64 trained positions), has kiln decode the three
short prompts in one batch past 64 positions, and for each prompt compares, step by step:
transformers' `generate` (greedy, its own logits), kiln's log-probabilities, and a forward
call over the sequence so far for every step (no cache: the short factors while the sequence
fits 64 positions, the long ones after), along each engine's own tokens.

    python3 diagnose.py --kiln KILN --tokenizer DIR --work DIR
"""
import argparse
import inspect
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../../../bench"))
import llama_parity as lp  # noqa: E402
import phi3_parity as pp  # noqa: E402


def prefix_logprobs(model, ids, new):
    """The log-probability of each of `new` from a forward call over the tokens before it."""
    out = []
    with torch.no_grad():
        for i, t in enumerate(new):
            x = torch.tensor([ids + new[:i]], device="cuda")
            out.append(torch.log_softmax(model(x).logits[0, -1].float(), -1)[t].item())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--work", default="/tmp/phi3-diag")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    print("transformers", tf.__version__)
    cls = tf.Phi3ForCausalLM
    own = "prepare_inputs_for_generation" in cls.__dict__
    print("Phi3ForCausalLM overrides prepare_inputs_for_generation:", own)
    if own:
        print(inspect.getsource(cls.prepare_inputs_for_generation))
    path = os.path.join(a.work, "longrope")
    model = lp.save(pp.long_config([round(1.0 + 0.5 * i, 4) for i in range(32)]), path,
                    a.tokenizer).cuda().eval()
    print("config rope_scaling:", getattr(model.config, "rope_scaling", "(none)"),
          "original_max_position_embeddings:",
          getattr(model.config, "original_max_position_embeddings", "(none)"))
    run = os.path.join(a.work, "run")
    r = pp.kiln_run(a.kiln, path, run, ["model.context=512", "train.seq_len=512", "train.steps=1",
                                        "optim.lr=1e-30", "optim.min_lr=0",
                                        "optim.warmup_steps=0", "optim.weight_decay=0"])
    assert r.returncode == 0, r.stderr[-500:]
    lines, note = lp.kiln_generate(a.kiln, ["--run", run], a.work, "cross", prompts=lp.PROMPTS,
                                   tokens=128)
    print("kiln:", note)
    for line in lines:
        ids, s = line["prompt_tokens"], line["samples"][0]
        g_tokens, g_lps = pp.generate_logprobs(model, ids, len(s["tokens"]))
        cross = 64 - len(ids)  # the first new token whose logits see more than 64 positions
        g_ref = prefix_logprobs(model, ids, g_tokens)
        k_ref = prefix_logprobs(model, ids, s["tokens"])
        first = next((i for i, (x, y) in enumerate(zip(g_tokens, s["tokens"])) if x != y), None)

        def gap(x, y, lo, hi):
            d = [abs(p - q) for p, q in zip(x[lo:hi], y[lo:hi])]
            return f"{max(d):.2e}" if d else "-"
        n = len(g_tokens)
        print(f"prompt of {len(ids)} tokens; new token {cross} is the first past 64 positions; "
              f"kiln and generate first differ at new token {first}")
        print(f"  generate against a forward per step: before {gap(g_lps, g_ref, 0, cross)}, "
              f"at {gap(g_lps, g_ref, cross, cross + 1)}, after {gap(g_lps, g_ref, cross + 1, n)}")
        print(f"  kiln against a forward per step:     before {gap(s['logprobs'], k_ref, 0, cross)}, "
              f"at {gap(s['logprobs'], k_ref, cross, cross + 1)}, after "
              f"{gap(s['logprobs'], k_ref, cross + 1, n)}")
        print(f"  kiln against generate (their own tokens, up to the first difference): "
              f"{gap(s['logprobs'], g_lps, 0, first if first is not None else n)}")


if __name__ == "__main__":
    main()
