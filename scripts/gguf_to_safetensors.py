"""`make vllm`'s model: python scripts/gguf_to_safetensors.py MODEL.gguf OUT converts a GGUF file to a float32
safetensors folder (config, weights, tokenizer) with transformers, for engines that cannot load GGUF (vLLM 0.32).

Run by the engine's own Python (it needs only transformers, torch and gguf).  The GGUF weights are dequantized on
load, so the folder holds exactly the weights transformers computes with when it reads the GGUF itself: the
in-process reference of an audit and the served model are the same numbers.
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_safetensors.py MODEL.gguf OUT")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantized: without the quantizer gone transformers refuses to save them, and an engine
    # reading the config's leftover GGUF quantization_config refuses the folder ("unknown quantization method")
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    print(f"{gguf.name} -> {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M float32 parameters)")
