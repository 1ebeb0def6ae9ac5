"""How far bf16 token log-probs are from fp32 ones for the same weights (CUDA if present).

    python bench/bf16_logprobs.py
"""

import torch

from plancc.logprobs import token_logprobs
from plancc.models import build_model, load_config


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_config("tiny-qwen3")
    torch.manual_seed(0)
    fp32 = build_model(config, device=device).eval()
    bf16 = build_model(config, device=device).eval()
    bf16.load_state_dict(fp32.state_dict())
    bf16.to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (8, 256), device=device)
    with torch.no_grad():
        a = token_logprobs(fp32, ids)
        b = token_logprobs(bf16, ids)
    diff = (a - b).abs()
    print(f"{device}: bf16 vs fp32 token log-probs over {ids.numel()} tokens: max |diff| {diff.max():.3e}, "
          f"mean {diff.mean():.3e}, mean |logp| {a.abs().mean():.3f}")


if __name__ == "__main__":
    main()
