"""kiln's phi3 GGUF export against llama.cpp's own converter, in one run.

transformers builds random-initialised Phi3ForCausalLM models shaped like Phi-3.5-mini (heads of
96, LongRoPE) and Phi-4-mini (grouped-query heads of 128, three quarters rotated, LongRoPE, a
tied head), two layers each and narrower than the published ones, and saves them. Then:

- llama.cpp's convert_hf_to_gguf.py writes each directory as an f32 GGUF file;
- `kiln export --init-from DIR --to FILE.gguf --outtype f32` writes the same directory;
- gguf-py reads both: every tensor's name, shape and values, and every metadata key the
  converter wrote, compared (the context length shown beside, not compared; and two
  differences kiln makes on purpose, listed beside);
- kiln decodes from its own export, transformers from the directory: greedy tokens and
  log-probabilities compared (llama_parity.py's comparison).

    python3 bench/phi3_gguf_export_check.py --kiln KILN --tokenizer DIR --llama-cpp SRC
"""

import argparse
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_parity as lp  # noqa: E402
import phi3_parity as pp  # noqa: E402


def shapes():
    common = dict(num_hidden_layers=2, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=1,
                  eos_token_id=2, vocab_size=49152, max_position_embeddings=131072,
                  sliding_window=262144)
    mini35 = pp.phi3(hidden_size=768, intermediate_size=2048, num_attention_heads=8,
                     num_key_value_heads=8, tie_word_embeddings=False,
                     longrope=(pp.SHORT, pp.LONG, 4096), **common)
    phi4mini = pp.phi3(hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                       num_key_value_heads=4, partial_rotary_factor=0.75, tie_word_embeddings=True,
                       longrope=(pp.SHORT, pp.LONG, 4096), **common)
    return [("phi-3.5-mini-shaped", mini35), ("phi-4-mini-shaped", phi4mini)]


def read_gguf(path, gguf):
    r = gguf.GGUFReader(path)
    tensors = {t.name: (tuple(int(d) for d in t.shape), np.array(t.data)) for t in r.tensors}
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        v = field.contents()
        meta[name] = v
    return tensors, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    ap.add_argument("--llama-cpp", required=True,
                    help="a llama.cpp source tree (convert_hf_to_gguf.py, conversion/, gguf-py/)")
    ap.add_argument("--work", default="/tmp/kiln-phi3-gguf")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.llama_cpp, "gguf-py"))
    import gguf  # noqa: E402
    os.makedirs(a.work, exist_ok=True)
    print("transformers", tf.__version__, flush=True)
    rows = []
    failed = False
    for name, cfg in shapes():
        src = os.path.join(a.work, name)
        shutil.rmtree(src, ignore_errors=True)
        torch.manual_seed(0)
        model = tf.Phi3ForCausalLM(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(src)
        for f in os.listdir(a.tokenizer):
            shutil.copy(os.path.join(a.tokenizer, f), src)
        pp.converter_tokenizer(src)
        ref = os.path.join(a.work, f"{name}.converter.gguf")
        ours = os.path.join(a.work, f"{name}.kiln.gguf")
        env = dict(os.environ, PYTHONPATH=os.path.join(a.llama_cpp, "gguf-py"))
        r = subprocess.run([sys.executable, os.path.join(a.llama_cpp, "convert_hf_to_gguf.py"), src,
                            "--outtype", "f32", "--outfile", ref], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            rows.append((name, "converter failed", r.stderr.strip()[-300:]))
            failed = True
            continue
        r = subprocess.run([a.kiln, "export", "--init-from", src, "--to", ours, "--outtype", "f32"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            rows.append((name, "kiln export failed", r.stderr.strip()[-300:]))
            failed = True
            continue
        print(r.stderr.strip(), flush=True)
        (rt, rm), (kt, km) = read_gguf(ref, gguf), read_gguf(ours, gguf)
        names_equal = sorted(rt) == sorted(kt)
        same_tensors = sum(1 for n in rt if n in kt and rt[n][0] == kt[n][0]
                           and np.array_equal(rt[n][1], kt[n][1]))
        # Differences kiln makes on purpose: the window where the converter copies one at
        # least as long as the positions (full attention: kiln writes 0), and add_eos_token
        # left to llama.cpp's default where the converter writes that default (false).
        expected, differing = [], []
        positions = rm.get("phi3.context_length", 0)
        for k, v in rm.items():
            if k.startswith("general.") and k != "general.architecture":
                continue
            if k == "phi3.attention.sliding_window" and km.get(k) == 0 and v >= positions:
                expected.append(f"window {v} written as 0")
            elif k == "tokenizer.ggml.add_eos_token" and k not in km and v is False:
                expected.append("add_eos_token (false) not written")
            elif k not in km:
                differing.append(f"{k} missing")
            elif k.endswith(".context_length"):
                continue
            elif isinstance(v, float) or isinstance(km[k], float):
                if abs(float(v) - float(km[k])) > 1e-6 * max(1.0, abs(float(v))):
                    differing.append(f"{k}: {v} vs {km[k]}")
            elif v != km[k]:
                shown = (str(v)[:60], str(km[k])[:60])
                differing.append(f"{k}: {shown[0]} vs {shown[1]}")
        ok = names_equal and same_tensors == len(rt) and not differing
        failed |= not ok
        rows.append((f"{name}: kiln's export against the converter's",
                     f"{same_tensors}/{len(rt)} tensors identical"
                     + ("" if names_equal else f" (names differ: {sorted(set(rt) ^ set(kt))})"),
                     "metadata: " + ("every converter key equal" if not differing else "; ".join(differing))
                     + f" (context_length {rm.get('phi3.context_length')} vs {km.get('phi3.context_length')}; "
                     + ", ".join(expected) + ")"))
        print(rows[-1], flush=True)
        hf = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
        lines, note = lp.kiln_generate(a.kiln, ["--init-from", ours], a.work, name)
        if lines is None:
            rows.append((f"{name}: kiln decoding its export", "kiln generate failed", note))
            failed = True
            continue
        same, total, worst = lp.compare(hf, lines)
        rows.append((f"{name}: kiln decoding its export, transformers the directory",
                     f"{same}/{total} greedy tokens identical", f"max |logprob diff| {worst:.2e}"))
        failed |= same != total
        print(rows[-1], flush=True)
        del hf, model
        torch.cuda.empty_cache()
    print("\n| check | result | detail |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
