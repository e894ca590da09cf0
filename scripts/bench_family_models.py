"""Save the three architecture benchmark models of docs/benchmarks.md ("What the architecture buys"): a Qwen3.5-style
hybrid (Gated DeltaNet and full attention, 3:1), a DeepSeek-V3-style multi-head latent attention model and a gpt-oss
model (attention sinks, sliding and full layers), each from its family's own config class at hidden 512 and 8
layers (`tiny_models.tiny_config` with larger sizes), float32, random weights. Prints, per folder, the attention state
a branch holds per prefix token, and for the MLA model what expanded K/V would hold instead. Then bench each:

    .venv/bin/python scripts/bench_family_models.py /tmp/family-bench
    .venv/bin/branchreplay bench --model /tmp/family-bench/qwen3_5_text --scenario shared-prompt \\
        --prompt-tokens 4096 --generations 8 --response-tokens 128 --methods naive,branchreplay
"""

import argparse
import pathlib

SIZES = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             intermediate_size=1536, vocab_size=2048, max_position_embeddings=8192)
MODELS = {
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
                         linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64),
    "deepseek_v3": dict(num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32,
                        qk_nope_head_dim=64, v_head_dim=64, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=256, n_group=2, topk_group=1),
    "gpt_oss": dict(sliding_window=128, num_local_experts=8, num_experts_per_tok=2, intermediate_size=512,
                    layer_types=["sliding_attention", "full_attention"] * 4, max_position_embeddings=8192,
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=256, rope_theta=150000.0)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="folder to save the three model folders in")
    args = parser.parse_args()
    import torch

    from branchreplay.engine.families import state_bytes_per_token
    from branchreplay.tiny_models import tiny_model

    for arch, extra in MODELS.items():
        overrides = {**SIZES, **extra}
        if "layer_types" in extra:
            overrides["layer_types"] = (extra["layer_types"] * SIZES["num_hidden_layers"])[:SIZES["num_hidden_layers"]]
        model = tiny_model(arch, dtype=torch.float32, initializer_range=0.02, **overrides)
        model.save_pretrained(args.out / arch)
        full, sliding = state_bytes_per_token(model.config, torch.float32)
        line = f"{arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, state {full:,} B per " \
               f"prefix token + at most {sliding:,} B in sliding layers"
        if arch == "deepseek_v3":
            c = model.config
            per_head = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim  # one key and one value per head
            expanded = c.num_attention_heads * per_head * 4 * c.num_hidden_layers
            line += f" (expanded K/V would hold {expanded:,} B, {expanded / full:.1f}x)"
        print(line)


if __name__ == "__main__":
    main()
