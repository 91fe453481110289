"""What a published version weighs under train.lora, against the whole model: the adapter's tensors as the trainer
publishes them (train/lora.py published_adapter) on SmolLM2-135M-Instruct, at ranks 1, 8 and 32, adapting every
linear (all-linear) or q_proj and v_proj only. Counted on the meta device: exact, nothing computed. Writes
publish_bytes.json.

    .venv/bin/python results/bench/lora/publish_bytes.py
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dora_hpc.engine.local_models import convert_smollm2
from dora_hpc.train.lora import LoraSpec, attach, published_adapter

if __name__ == "__main__":
    cfg = AutoConfig.from_pretrained(convert_smollm2())
    rows = []
    for mods in ("all-linear", ("q_proj", "v_proj")):
        for rank in (1, 8, 32):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(cfg)
                whole = sum(p.numel() for p in model.parameters())
                adapter = sum(t.numel() for t in published_adapter(attach(model, LoraSpec(rank, 32.0, mods))).values())
            rows.append({"target_modules": mods if isinstance(mods, str) else list(mods), "rank": rank,
                         "adapter_params": adapter, "model_params": whole, "share": adapter / whole})
    (Path(__file__).parent / "publish_bytes.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(r["target_modules"], r["rank"], f"{r['share']:.2%}")
