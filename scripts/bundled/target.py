"""The target: a ``Qwen3_5ForCausalLM`` trained from scratch with its MTP head, and its Hugging Face folder.

The shape is an engine :class:`ModelConfig` (validated once); transformers gets the same numbers through
``ModelConfig.to_hf()``, which is also the folder's config.json. Embeddings are tied: with an 8K vocabulary
the table is a fifth of the parameters, and the artifact must stay under 40 MB with both drafters in it.

Training: bf16 autocast over fp32 master weights, AdamW, warm-up + cosine (``schedule.Schedule``), the
wall-clock budget deciding the number of steps. Loss = next-token cross-entropy + ``mtp_weight`` x the MTP
head's depth-0 loss (gradients reach the trunk, as in Qwen3.5's joint training).
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ninfer_bench.engine.model.config import ModelConfig

from .mtp import MTPHead, mtp_loss
from .schedule import Schedule

COMMON = dict(rope_theta=1e7, partial_rotary_factor=0.25, tie_word_embeddings=True, max_position_embeddings=131072,
              mtp_num_hidden_layers=1, eos_token_id=(0,))
SHAPES = {
    # 8 layers = 2 x [3 GDN + 1 full]; GDN v heads = 3 x k heads, 6 query heads per kv head (27B ratios)
    # GDN head dim 128 as in the 27B; it also keeps fla's backward off the Hopper miscompile (fla #640: BK=64)
    "small": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
                  num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=3,
                  linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=6,
                 num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                 linear_key_head_dim=16, linear_value_head_dim=16),
}


def model_config(shape: str, vocab_size: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, **SHAPES[shape], **COMMON)


def hf_config(cfg: ModelConfig):
    import transformers

    d = {k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type")}
    hf = transformers.Qwen3_5TextConfig(**d)
    hf._attn_implementation = "sdpa"
    return hf


def new_model(cfg: ModelConfig, seed: int):
    """A freshly initialised (seeded) fp32 target and MTP head."""
    import transformers

    torch.manual_seed(seed)
    hf = hf_config(cfg)
    model = transformers.Qwen3_5ForCausalLM(hf)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head to embed_tokens")
    return model, MTPHead(hf, cfg.mtp_num_hidden_layers)


def run(model, ids: torch.Tensor, taps=()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Final-normed hidden states ``[B, T, H]`` and the outputs of decoder layers ``taps`` (before the norm)."""
    got = {}

    def keep(i, _module, _args, out):
        got[i] = out[0] if isinstance(out, tuple) else out

    hooks = [model.model.layers[i].register_forward_hook(functools.partial(keep, i)) for i in taps]
    try:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return hidden, [got[i] for i in taps]


def rotary(model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (cos, sin) at positions 0..T-1 of ``x [B, T, H]`` (text positions: the three mRoPE streams
    are equal)."""
    b, t = x.shape[:2]
    pos = torch.arange(t, device=x.device)[None, None].expand(3, b, t)
    return model.model.rotary_emb(x, pos)


# ---- which GDN kernels transformers runs ----------------------------------------------------------------------
CALLS: dict[str, int] = {}


FLA_SHIM = "fla.ops.gated_delta_rule.chunk_gated_delta_rule (installed here)"


def _hub_func(fn):
    """The function inside a hub-kernel ``Func`` module (transformers >= 5.25 with Hugging Face's ``kernels``
    installed wraps each kernel function in one: ``forward`` calls its closure's ``func``); ``fn`` itself otherwise."""
    forward = getattr(type(fn), "forward", None)
    if hasattr(fn, "__code__") or forward is None or not getattr(forward, "__closure__", None):
        return fn
    return dict(zip(forward.__code__.co_freevars, (c.cell_contents for c in forward.__closure__))).get("func", fn)


def _implementation(fn) -> str:
    """The function transformers' hub-kernel wrapper resolved to (its closure's ``implementation``)."""
    fn = _hub_func(fn)
    while getattr(fn, "counted", False):
        fn = _hub_func(fn.__wrapped__)
    if getattr(fn, "fla_shim", False):
        return FLA_SHIM
    env = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    impl = env.get("implementation", fn)
    return f"{impl.__module__}.{impl.__qualname__}"


def _counted(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS[name] = CALLS.get(name, 0) + 1
        return fn(*args, **kwargs)
    wrapper.counted = True
    return wrapper


def _fla_chunk(fla_fn):
    """transformers' ``torch_chunk_gated_delta_rule`` signature over fla's ``chunk_gated_delta_rule``."""
    def chunk(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
        return fla_fn(query, key, value, g=g, beta=beta, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=kwargs.get("cu_seqlens"))
    chunk.fla_shim = True
    return chunk


def _reference(fn):
    """Down the wrappers (our counter, transformers' hub-kernel wrapper) to transformers' torch reference."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def grad_check(fla_chunk, reference, cfg: ModelConfig, device: torch.device, seed: int = 0,
               tol: float = 0.05) -> dict:
    """fla's gated delta rule against transformers' torch reference at the model's GDN shape: outputs and the
    gradients of every input, relative RMS (bf16 inputs; the reference computes in fp32)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, h, dk, dv = 2, 256, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    raw = {"query": torch.randn(b, t, h, dk, generator=gen, device=device),
           "key": torch.randn(b, t, h, dk, generator=gen, device=device),
           "value": torch.randn(b, t, h, dv, generator=gen, device=device),
           "g": -F.softplus(torch.randn(b, t, h, generator=gen, device=device)),
           "beta": torch.sigmoid(torch.randn(b, t, h, generator=gen, device=device))}
    weight = torch.randn(b, t, h, dv, generator=gen, device=device)
    raw = {k: v.to(torch.bfloat16).float() for k, v in raw.items()}
    got = {}
    for name, fn, dtype in (("fla", fla_chunk, torch.bfloat16), ("reference", reference, torch.float32)):
        xs = {k: v.to(dtype).requires_grad_() for k, v in raw.items()}
        out = fn(**xs, use_qk_l2norm_in_kernel=True)[0].float()
        (out * weight).sum().backward()
        got[name] = {"out": out.detach(), **{k: v.grad.float() for k, v in xs.items()}}
    rel = {k: float((got["fla"][k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in got["reference"].items()}
    return {"rel_rms": {k: round(v, 5) for k, v in rel.items()}, "tolerance": tol,
            "ok": all(v <= tol for v in rel.values())}


def _lift_hopper_guard() -> bool:
    """fla refuses its gated backward on Hopper with Triton 3.4-3.7.0 (fla #640: a miscompile at BK=64); at head
    dim 128 the kernel tiles with BK=128. Lift the refusal (``grad_check`` then decides); True if it was set."""
    try:
        from fla.ops.common import chunk_o
    except Exception:  # no fla, or a layout without the guard
        return False
    if getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) is False:
        chunk_o.TRITON_ABOVE_3_7_1 = True
        return True
    return False


def gdn_kernels(device: torch.device, cfg: ModelConfig | None = None) -> dict:
    """Report (and on CUDA insist on) fla's chunked gated delta rule, and count calls of each kernel.

    transformers resolves ``chunk_gated_delta_rule`` from fla when fla imports at the time its Qwen3.5 module
    is first imported; if it fell back to its torch reference although fla imports now, fla's is installed.
    On a CPU the torch references run (fla's Triton kernels take CUDA tensors only)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    info = {"chunk_gated_delta_rule": _implementation(mq.torch_chunk_gated_delta_rule),
            "causal_conv1d_fn": _implementation(mq.causal_conv1d_fn)}
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        info["fla"] = getattr(fla, "__version__", "?")
    except Exception as e:  # any import failure means: no fla
        chunk_gated_delta_rule = None
        info["fla"] = f"not importable ({type(e).__name__}: {e})"
    if device.type == "cuda" and chunk_gated_delta_rule is not None \
            and not info["chunk_gated_delta_rule"].startswith("fla."):
        mq.torch_chunk_gated_delta_rule = _fla_chunk(chunk_gated_delta_rule)
        info["chunk_gated_delta_rule"] = FLA_SHIM
    elif device.type != "cuda" and info["chunk_gated_delta_rule"].startswith("fla"):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):  # fla needs CUDA tensors
            setattr(mq, name, _reference(getattr(mq, name)))
        info["chunk_gated_delta_rule"] = _implementation(mq.torch_chunk_gated_delta_rule)
    if device.type == "cuda" and chunk_gated_delta_rule is not None and cfg is not None:
        info["hopper_guard_lifted"] = _lift_hopper_guard()
        check = grad_check(_fla_chunk(chunk_gated_delta_rule), _reference(mq.torch_chunk_gated_delta_rule), cfg,
                           device)
        info["fla_grad_check"] = check
        if not check["ok"]:  # wrong gradients: train through the torch reference (slower, correct)
            mq.torch_chunk_gated_delta_rule = _reference(mq.torch_chunk_gated_delta_rule)
            info["chunk_gated_delta_rule"] = _implementation(mq.torch_chunk_gated_delta_rule)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(mq, name)
        if not getattr(fn, "counted", False):
            setattr(mq, name, _counted(name, fn))
    return info


# ---- training -------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TargetOptions:
    seq_len: int
    batch: int
    lr: float
    warmup: int
    budget_s: float
    max_steps: int | None = None
    mtp_weight: float = 0.3
    weight_decay: float = 0.1
    clip: float = 1.0
    log_every: int = 10
    long_frac: float = 0.0  # the last fraction of the budget (or of max_steps) trains on the long batches


def losses(model, mtp, x: torch.Tensor, depths: int = 1):
    """(next-token loss, MTP loss) of rows ``x [B, T+1]``: the target reads x[:, :T]."""
    ids = x[:, :-1]
    hidden, _ = run(model, ids)
    logits = model.lm_head(hidden)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
    emb_next = model.model.embed_tokens(x[:, 1:])  # token p+1 for entry p
    labels = torch.cat([x[:, 2:], torch.full_like(x[:, :1], -100)], dim=1)  # token p+2
    cos, sin = rotary(model, hidden)
    m_loss, _ = mtp_loss(mtp, model.lm_head, hidden, emb_next, labels, cos, sin, depths)
    return loss, m_loss


def optimizer(params, lr: float, weight_decay: float, device: torch.device):
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train(model, mtp, batches, opts: TargetOptions, device: torch.device, log, long_batches=None) -> dict:
    """Train target + MTP until the budget or ``max_steps``; ``log(row)`` gets a row every ``log_every`` steps.

    With ``long_batches`` (same tokens per step, longer rows) the last ``long_frac`` of the run reads those:
    retrieval and attention are then trained at more than the base context."""
    model.to(device).train()
    mtp.to(device).train()
    CALLS.clear()
    params = list(model.parameters()) + list(mtp.parameters())
    opt = optimizer(params, opts.lr, opts.weight_decay, device)
    sched = Schedule(opts.lr, opts.warmup, opts.budget_s, opts.max_steps)
    step, tokens, first_step_s, window = 0, 0, None, (time.perf_counter(), 0)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    long_steps = 0
    while True:
        late = (step >= opts.max_steps * (1 - opts.long_frac)) if opts.max_steps else \
            (sched.elapsed >= opts.budget_s * (1 - opts.long_frac))
        source = long_batches if long_batches is not None and late else batches
        long_steps += source is long_batches
        x = torch.from_numpy(source.next())
        x = (x.pin_memory() if device.type == "cuda" else x).to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = sched.lr(step)
        with amp:
            loss, m_loss = losses(model, mtp, x)
            total = loss + opts.mtp_weight * m_loss
        loss, m_loss = loss.detach(), m_loss.detach()
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, opts.clip)
        opt.step()
        step += 1
        tokens += x.shape[0] * (x.shape[1] - 1)
        if first_step_s is None:
            first_step_s = sched.elapsed
        stop = sched.done(step)
        if step % opts.log_every == 0 or stop or step == 3:
            now = time.perf_counter()
            tok_s = (tokens - window[1]) / max(1e-9, now - window[0])
            window = (now, tokens)
            log({"phase": "target", "step": step, "loss": float(loss), "mtp_loss": float(m_loss), "tokens": tokens,
                 "lr": sched.lr(step - 1), "elapsed": round(sched.elapsed, 2), "tok_s": round(tok_s),
                 "seq_len": x.shape[1] - 1, "total_steps": sched.total})
        if stop:
            break
    return {"steps": step, "tokens": tokens, "seconds": round(sched.elapsed, 1), "first_step_s": round(first_step_s, 1),
            "planned_steps": sched.total, "batch": opts.batch, "seq_len": opts.seq_len, "peak_lr": opts.lr,
            "warmup": opts.warmup, "mtp_weight": opts.mtp_weight, "final_loss": float(loss),
            "final_mtp_loss": float(m_loss), "long_steps": long_steps,
            "long_seq_len": long_batches.seq_len if long_batches is not None else None,
            "epochs": round(sum(b.rows * b.seq_len for b in (batches, long_batches) if b is not None)
                            / (len(batches.stream) - 1), 2),
            "kernel_calls": dict(CALLS)}


def param_counts(model, mtp) -> dict:
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    emb = model.model.embed_tokens.weight.numel()
    return {"target": sum(unique.values()), "target_non_embedding": sum(unique.values()) - emb,
            "embedding": emb, "mtp": sum(p.numel() for p in mtp.parameters())}


# ---- the Hugging Face folder --------------------------------------------------------------------------------
def save_hf(folder: Path, cfg: ModelConfig, model, mtp, tokenizer_dir: Path) -> None:
    """config.json, model.safetensors (target + ``mtp.*`` in bf16: 50 MB, small enough to carry back into a
    device call), generation_config.json, tokenizer files."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    tensors.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    save_file({k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in tensors.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf(), "torch_dtype": "bfloat16"}, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(cfg.eos_token_id), "do_sample": False}, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())


def load_hf(folder: Path, device: torch.device):
    """(model, mtp, config) from a folder written by :func:`save_hf`."""
    import transformers

    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    hf = hf_config(cfg)
    model = transformers.Qwen3_5ForCausalLM(hf)
    mtp = MTPHead(hf, cfg.mtp_num_hidden_layers)
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")},
                                                strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:
        raise RuntimeError(f"{folder}: target weights do not match (missing {missing}, unexpected {unexpected})")
    mtp.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("mtp.")}, strict=True)
    return model.to(device), mtp.to(device), cfg
