"""Tiny Hugging Face checkpoints made by transformers inside the tests."""

from __future__ import annotations

import torch

TEXT_KW = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=24,
               intermediate_size=96, vocab_size=300, max_position_embeddings=4096)


def _perturb(model, seed: int) -> None:
    """Move 1-D parameters (norms, A_log, dt_bias) away from their init so 1 vs 1+w mistakes show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def make_hf(kind: str, folder, *, tied: bool = False, seed: int = 0, **overrides):
    """Build, perturb and save a tiny transformers model of ``kind``; returns the model (eval, fp32)."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TEXT_KW, **overrides, "tie_word_embeddings": tied}
    if kind == "qwen3_5":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**kw))
    elif kind == "qwen3_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=kw["hidden_size"])
        text = {k: v for k, v in kw.items() if k != "tie_word_embeddings"}
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision,
                                                                     tie_word_embeddings=tied))
    elif kind == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**kw, num_experts=0))
    else:
        raise ValueError(kind)
    _perturb(model, seed)
    model.eval()
    model.save_pretrained(folder)
    return model


