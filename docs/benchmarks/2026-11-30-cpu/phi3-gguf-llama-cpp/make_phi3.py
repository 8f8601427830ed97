"""SmolLM2-135M-Instruct as a Phi3ForCausalLM directory with LongRoPE, from kiln's Hugging Face
export of the fixture (`kiln export --init-from SmolLM2-135M-Instruct.Q4_1.gguf --to SRC`):
q/k/v and gate/up fused as Phi-3 stores them; short factors 1.00-1.31 over 2048 trained
positions of 8192. Needs numpy and safetensors.

    python3 make_phi3.py SRC DST
"""
import json
import shutil
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
w = load_file(f"{src}/model.safetensors")
c = json.load(open(f"{src}/config.json"))
layers = c["num_hidden_layers"]
fused = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
out = {k: v for k, v in w.items() if not any(f".{n}." in k for n in fused)}
for i in range(layers):
    p = f"model.layers.{i}"
    out[f"{p}.self_attn.qkv_proj.weight"] = np.concatenate(
        [w[f"{p}.self_attn.{n}_proj.weight"] for n in "qkv"], 0)
    out[f"{p}.mlp.gate_up_proj.weight"] = np.concatenate(
        [w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"]], 0)
save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
cfg = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
    "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
    "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
    "num_hidden_layers": layers, "vocab_size": c["vocab_size"],
    "max_position_embeddings": 8192, "original_max_position_embeddings": 2048,
    "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"],
    "rope_scaling": {"type": "longrope", "short_factor": [round(1.0 + 0.01 * i, 4) for i in range(32)],
                     "long_factor": [round(1.0 + 0.5 * i, 4) for i in range(32)]},
    "sliding_window": None, "tie_word_embeddings": True, "hidden_act": "silu",
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
json.dump(cfg, open(f"{dst}/config.json", "w"), indent=1)
for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
    shutil.copy(f"{src}/{f}", f"{dst}/{f}")
