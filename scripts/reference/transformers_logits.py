#!/usr/bin/env python3
"""Writes the reference logits of tests/transformers_reference.rs: for each small config
below, pensieve's `random_checkpoint` example writes seeded random weights (Hugging Face
names), Hugging Face `transformers` runs them on a fixed prompt, and the last position's
logits go to tests/fixtures/transformers/NAME.json with the config, the seed and the prompt.
The test writes the same weights again from the seed, so CI needs neither torch nor the
checkpoints.

Each fixture also keeps `saved_config`: the config as this `transformers` saves it
(`save_pretrained`; 5.x writes `rope_parameters` where 4.x wrote `rope_theta` and
`rope_scaling`, and renames fields). The test loads the weights under both forms, to the same
logits.

Run where `transformers` and a CPU `torch` are installed (both from PyPI):
    python scripts/reference/transformers_logits.py
With `--configs-only`, only `saved_config` is rewritten, and torch is not needed.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

import transformers

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "transformers"
SEED = 42
PROMPT = [(i * 37 + 11) % 300 for i in range(24)]

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=256, tie_word_embeddings=False, rope_theta=10000.0,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

CASES = {
    # Phi-4-mini's shape of attention: three quarters of each head rotate, with LongRoPE
    # past the 8 positions it was "trained" on (the prompt is longer: long factors).
    "phi3_longrope_partial": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_act="silu", partial_rotary_factor=0.75,
        original_max_position_embeddings=8,
        rope_scaling={"type": "longrope",
                      "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                      "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]},
        **COMMON),
    # Qwen3 with YaRN over a window 8x the one it was trained with (the prompt spans the
    # ramp's dimensions), and with YaRN's ramp unrounded and its attention factor from mscale.
    "qwen3_yarn": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16,
        rope_scaling={"rope_type": "yarn", "factor": 8.0,
                      "original_max_position_embeddings": 32},
        **COMMON),
    "llama_yarn_mscale": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                      "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
                      "mscale": 0.707, "mscale_all_dim": 1.0},
        **COMMON),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, **COMMON),
    "qwen3_moe_unnormalized": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, **COMMON),
    # gpt-oss: attention sinks and biases, sliding and full layers in turn (the window
    # shorter than the prompt), YaRN, experts with biases behind a biased router, the clamped
    # SwiGLU.
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, attention_bias=True, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], swiglu_limit=7.0,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                      "truncate": False, "original_max_position_embeddings": 32},
        **COMMON),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
        **COMMON),
}


def saved(config):
    """`config` as `save_pretrained` writes it."""
    fields = {k: v for k, v in config.items() if k != "model_type"}
    with tempfile.TemporaryDirectory() as folder:
        transformers.AutoConfig.for_model(config["model_type"], **fields).save_pretrained(folder)
        out = json.loads((pathlib.Path(folder) / "config.json").read_text())
    # The version is the fixture's `reference`; the rest is what a checkpoint carries.
    out.pop("transformers_version", None)
    return out


def logits(config, folder):
    import torch

    folder = pathlib.Path(folder)
    (folder / "case.json").write_text(json.dumps(config))
    subprocess.run(["cargo", "run", "--release", "--quiet", "--example", "random_checkpoint",
                    "--", str(folder / "case.json"), str(SEED), str(folder / "model")],
                   cwd=ROOT, check=True)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "model", dtype=torch.float32, output_loading_info=True)
    # Every weight read from the checkpoint, none left to random initialization.
    assert not any(info.values()), info
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT])).logits[0, -1]
    return [float(x) for x in out]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for name, config in CASES.items():
        if "--configs-only" in sys.argv:
            fixture = json.loads((OUT / f"{name}.json").read_text())
            fixture["saved_config"] = saved(config)
            fixture["saved_by"] = f"transformers {transformers.__version__}"
            (OUT / f"{name}.json").write_text(json.dumps(fixture) + "\n")
            continue
        import torch
        with tempfile.TemporaryDirectory() as folder:
            values = logits(config, folder)
        fixture = {"config": config, "saved_config": saved(config),
                   "saved_by": f"transformers {transformers.__version__}",
                   "seed": SEED, "prompt": PROMPT, "logits": values,
                   "reference": f"transformers {transformers.__version__}, "
                                f"torch {torch.__version__}"}
        (OUT / f"{name}.json").write_text(json.dumps(fixture) + "\n")
        print(f"{name}: {len(values)} logits", file=sys.stderr)


if __name__ == "__main__":
    main()
