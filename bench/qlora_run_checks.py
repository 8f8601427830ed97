"""Checks of a finished `kiln finetune --qlora` run on the GPU machine, shared by the QLoRA
scripts: the loss falls (mean of the first five steps against the last five), the merged
export loads in transformers with finite logits that differ from the base's, and PEFT loads
the run's adapter onto the base and changes its logits. With --nf4-bound the merged export's
projections must differ from PEFT's merge of the exact base by the NF4 error alone (at most
that fraction of a projection's largest weight). Prints PASS/FAIL lines; exits 1 on a failure.

    python3 bench/qlora_run_checks.py --base DIR --run RUN --merged DIR [--nf4-bound 0.15]
"""

import argparse
import json
import sys

import torch
import transformers as tf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--nf4-bound", type=float, default=None)
    a = ap.parse_args()
    ok = True

    def check(name, cond, detail):
        nonlocal ok
        print(("PASS " if cond else "FAIL ") + name + " " + detail)
        ok &= bool(cond)

    losses = [json.loads(l) for l in open(f"{a.run}/metrics.jsonl")]
    losses = [r["loss"] for r in losses if isinstance(r.get("loss"), (int, float))]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    check("qlora-loss-falls", last < first - 0.1,
          f"(first 5 steps {first:.3f}, last 5 {last:.3f})")
    load = lambda d: tf.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).cuda().eval()
    base, merged = load(a.base), load(a.merged)
    ids = torch.randint(0, base.config.vocab_size, (2, 64),
                        generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        lb, lm = base(ids).logits, merged(ids).logits
    rel = ((lm - lb).norm() / lb.norm()).item()
    check("qlora-merged-loads", torch.isfinite(lm).all().item() and rel > 0,
          f"(merged export in transformers: finite logits, {rel:.3f} from the base's relative to their norm)")
    try:
        import peft
        pm = peft.PeftModel.from_pretrained(load(a.base), f"{a.run}/adapter").eval()
        with torch.no_grad():
            lp = pm(ids).logits
        check("qlora-peft-loads", torch.isfinite(lp).all().item() and not torch.equal(lp, lb),
              "(peft.PeftModel.from_pretrained(base, run/adapter): the adapters change the logits)")
        if a.nf4_bound is not None:
            # kiln's merge is the NF4 base plus the adapters; PEFT's the exact base plus the
            # same adapters: they differ by the NF4 error alone, at most half the widest gap of
            # the code book (0.723 to 1) times a block's absmax.
            exact = pm.merge_and_unload().state_dict()
            worst = 0.0
            for k, m in merged.state_dict().items():
                if k.endswith("_proj.weight"):
                    worst = max(worst, ((m - exact[k]).abs().max() / exact[k].abs().max()).item())
            check("qlora-merged-is-nf4-plus-adapters", 0 < worst <= a.nf4_bound,
                  f"(largest difference from PEFT's merge of the exact base: {worst:.4f} of a projection's largest weight)")
    except Exception as e:  # noqa: BLE001 -- report, do not crash the check
        check("qlora-peft", False, f"({type(e).__name__}: {e})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
