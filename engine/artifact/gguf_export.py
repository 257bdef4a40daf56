"""A model's text decoder as a GGUF file that llama.cpp loads as ``qwen35``, written with the ``gguf`` package.

Exact where the formats allow, refused where they do not:

* ``q8_g32_fp16`` -> ``Q8_0`` (a group is a block: fp16 scale, 32 int8 codes);
* ``q4_g64_fp16`` -> two ``Q4_0`` blocks per group, both with the group's scale (nibble = code + 8);
* ``q5_g64_fp16`` -> two ``Q5_0`` blocks per group likewise (5-bit code + 16, the fifth bits in ``qh``);
* ``fp32`` / ``bf16`` as they are (``F32`` / ``BF16``).

So ``gguf``'s own dequantization of every exported tensor equals ours bit for bit (a test holds it). A quantized
tensor whose K is not a multiple of 32 (ggml's block) is refused. What llama.cpp's ``qwen35`` graph expects beyond
the bytes is applied as its own converter does (``convert_hf_to_gguf.py``), each an exact rearrangement or one fp32
operation on an fp32 tensor: the zero-centred RMSNorm weights become ``1 + w``; ``A_log`` becomes ``-exp(A_log)``
(``ssm_a``); the conv kernel loses its middle axis; where there are more GDN value heads than key heads, the value
heads go from grouped order (by key head) to tiled order - rows of ``in_proj_qkv``'s v part, ``in_proj_z``,
``in_proj_a`` / ``in_proj_b``, ``A_log``, ``dt_bias`` and the conv's v channels, whole 32-column blocks of
``out_proj`` (refused unless the value head size is a multiple of 32).

Not exported (said in the result): the MTP head, the DFlash drafters and a vision tower. The tokenizer goes in as
llama.cpp's ``gpt2`` BPE vocabulary (byte-level tokenizer.json: tokens, merges, the pre-tokenizer recognised from its
regex; the byte tokenizer of presets: 256 byte tokens and no merges), with the chat template.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...kernels import quant
from ..model.config import FULL, ModelConfig

ARCH = "qwen35"
BLOCK = 32  # ggml's block for Q8_0 / Q4_0 / Q5_0
GGML_TYPE_OF = {"q8_g32_fp16": "Q8_0", "q4_g64_fp16": "Q4_0", "q5_g64_fp16": "Q5_0", "fp32": "F32", "bf16": "BF16"}
# llama.cpp's pre-tokenizer names for the Split regexes of tokenizer.json it knows (src/llama-vocab.cpp)
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
KNOWN_SPLITS = {QWEN2_REGEX: "qwen2", QWEN35_REGEX: "qwen35"}
NO_MERGE = "<|no-merge|>"  # a symbol no merge list makes


class ExportError(ValueError):
    """What cannot be exported exactly (or at all), in one line."""


@dataclass
class ExportResult:
    path: str
    tensors: int
    bytes: int
    types: dict[str, int] = field(default_factory=dict)  # ggml type -> tensors
    skipped: list[str] = field(default_factory=list)  # components not exported, and why
    pre_tokenizer: str = ""


# ---- tensors ---------------------------------------------------------------------------------------------------


def _tiled(n_k: int, per_k: int, size: int) -> np.ndarray:
    """Index that takes value heads from grouped order (key head major) to tiled order (key head minor), each head
    ``size`` consecutive entries: llama.cpp broadcasts key heads over value heads in tiled order."""
    return np.arange(n_k * per_k * size).reshape(n_k, per_k, size).transpose(1, 0, 2).reshape(-1)


@dataclass(frozen=True)
class Plan:
    """How one artifact tensor becomes one GGUF tensor."""

    src: str
    dst: str
    rows: np.ndarray | None = None  # row permutation (None: as is)
    cols: np.ndarray | None = None  # column permutation, in whole 32-column blocks (None: as is)
    op: str = ""  # "", "plus_one", "neg_exp", "squeeze_conv"


def tensor_plans(cfg: ModelConfig, names: set[str]) -> list[Plan]:
    """The GGUF tensors of a text decoder, in file order, from the artifact's Hugging Face names."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    reorder = hk != hv
    per_k = hv // hk

    def v_rows(head: int) -> np.ndarray | None:  # value heads of ``head`` entries each, grouped -> tiled
        return _tiled(hk, per_k, head) if reorder else None

    plans = [Plan("model.embed_tokens.weight", "token_embd.weight"),
             Plan("model.norm.weight", "output_norm.weight", op="plus_one")]
    if "lm_head.weight" in names:  # (tied and absent: llama.cpp reads token_embd for the head too)
        plans.append(Plan("lm_head.weight", "output.weight"))
    for i, kind in enumerate(cfg.layer_types):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        plans += [Plan(p + "input_layernorm.weight", b + "attn_norm.weight", op="plus_one"),
                  Plan(p + "post_attention_layernorm.weight", b + "post_attention_norm.weight", op="plus_one")]
        if kind == FULL:
            a = p + "self_attn."
            plans += [Plan(a + "q_proj.weight", b + "attn_q.weight"), Plan(a + "k_proj.weight", b + "attn_k.weight"),
                      Plan(a + "v_proj.weight", b + "attn_v.weight"),
                      Plan(a + "o_proj.weight", b + "attn_output.weight"),
                      Plan(a + "q_norm.weight", b + "attn_q_norm.weight", op="plus_one"),
                      Plan(a + "k_norm.weight", b + "attn_k_norm.weight", op="plus_one")]
        else:
            a = p + "linear_attn."
            qk = 2 * hk * dk
            qkv_rows = (np.concatenate([np.arange(qk), qk + _tiled(hk, per_k, dv)]) if reorder else None)
            plans += [Plan(a + "in_proj_qkv.weight", b + "attn_qkv.weight", rows=qkv_rows),
                      Plan(a + "in_proj_z.weight", b + "attn_gate.weight", rows=v_rows(dv)),
                      Plan(a + "in_proj_b.weight", b + "ssm_beta.weight", rows=v_rows(1)),
                      Plan(a + "in_proj_a.weight", b + "ssm_alpha.weight", rows=v_rows(1)),
                      Plan(a + "conv1d.weight", b + "ssm_conv1d.weight", rows=qkv_rows, op="squeeze_conv"),
                      Plan(a + "A_log", b + "ssm_a", rows=v_rows(1), op="neg_exp"),
                      Plan(a + "dt_bias", b + "ssm_dt.bias", rows=v_rows(1)),
                      Plan(a + "norm.weight", b + "ssm_norm.weight"),
                      Plan(a + "out_proj.weight", b + "ssm_out.weight", cols=v_rows(dv))]
        m = p + "mlp."
        plans += [Plan(m + "gate_proj.weight", b + "ffn_gate.weight"), Plan(m + "up_proj.weight", b + "ffn_up.weight"),
                  Plan(m + "down_proj.weight", b + "ffn_down.weight")]
    missing = [pl.src for pl in plans if pl.src not in names]
    if missing:
        raise ExportError(f"the model has no {missing[0]} ({len(missing)} tensor(s) missing): not a complete "
                          f"Qwen3.5 text decoder")
    return plans


def _float_array(raw, plan: Plan) -> tuple[np.ndarray, str]:
    """An fp32 / bf16 tensor, transformed and permuted: (array, ggml type). bf16 stays bf16 unless an fp32
    operation applies (then F32, as llama.cpp's converter writes it)."""
    if plan.op or raw.fmt == "fp32":
        t = raw.dense(torch.float32).cpu()
        if plan.op == "plus_one":
            t = t + 1.0
        elif plan.op == "neg_exp":
            t = -torch.exp(t)
        elif plan.op == "squeeze_conv":
            t = t.reshape(t.shape[0], t.shape[-1])
        arr, kind = t.numpy(), "F32"
    else:  # bf16 as stored: its bits as uint16
        arr = raw.buf.cpu().reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16).reshape(raw.shape)
        kind = "BF16"
    if plan.rows is not None:
        arr = arr[plan.rows]
    if plan.cols is not None:
        arr = arr[:, plan.cols]
    return np.ascontiguousarray(arr), kind


def ggml_blocks(raw, rows: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    """ggml block bytes (uint8 [n, K/32 * block bytes], block-major within a row) of a packed q8 / q4 / q5 tensor,
    its rows taken in ``rows`` order: (bytes, ggml type). Byte shuffles only: a q4 byte holds codes 2j, 2j+1 (+8) in
    its nibbles, a Q4_0 byte codes j, j+16 of its block; q5's low nibbles likewise (+16, low four bits), and its high
    bits section already holds, per 32 codes, the little-endian uint32 ``qh`` of Q5_0. A group of 64 gives its scale
    to both of its blocks."""
    n, k = raw.shape  # (k a multiple of BLOCK: ggml_type checks it)
    group = quant.QSPEC[raw.fmt][0]
    sec = quant.sections(raw.buf.cpu().contiguous(), raw.fmt, (n, k))
    if rows is not None:
        idx = torch.from_numpy(rows)
        sec = {name: view[idx] for name, view in sec.items()}
    nb = k // BLOCK
    scales = sec["scales"].numpy()
    d = np.ascontiguousarray(np.repeat(scales, group // BLOCK, axis=1)[:, :nb]).view(np.uint8).reshape(n, nb, 2)
    codes = sec["codes"].numpy()
    if raw.fmt == "q8_g32_fp16":
        return np.concatenate([d, codes[:, :k].view(np.uint8).reshape(n, nb, BLOCK)], axis=-1).reshape(n, -1), "Q8_0"
    u = np.empty((n, codes.shape[1] * 2), dtype=np.uint8)
    u[:, 0::2] = codes & 0x0F
    u[:, 1::2] = codes >> 4
    u = u[:, :k].reshape(n, nb, BLOCK)
    qs = u[..., :16] | (u[..., 16:] << 4)
    if raw.fmt == "q4_g64_fp16":
        return np.concatenate([d, qs], axis=-1).reshape(n, -1), "Q4_0"
    qh = sec["high"].numpy()[:, :k // 8].reshape(n, nb, 4)
    return np.concatenate([d, qh, qs], axis=-1).reshape(n, -1), "Q5_0"


def _quant_array(raw, plan: Plan) -> tuple[np.ndarray, str]:
    out, kind = ggml_blocks(raw, plan.rows)
    if plan.cols is not None:
        cols = plan.cols.reshape(-1, BLOCK)
        if not (np.all(cols[:, 0] % BLOCK == 0) and np.all(cols == cols[:, :1] + np.arange(BLOCK))):
            raise ExportError(f"{plan.src}: the value heads' column order moves parts of 32-column blocks "
                              f"(linear_value_head_dim must be a multiple of {BLOCK})")
        n = out.shape[0]
        out = out.reshape(n, raw.shape[1] // BLOCK, -1)[:, cols[:, 0] // BLOCK].reshape(n, -1)
    return np.ascontiguousarray(out), kind


def ggml_type(raw, plan: Plan) -> str:
    """The ggml type one planned tensor is written as (an fp32 operation makes F32), or ExportError where it
    cannot be written exactly."""
    if raw.fmt in quant.QSPEC:
        if plan.op:
            raise ExportError(f"{plan.src} is stored {raw.fmt}; its export needs an fp32 operation ({plan.op})")
        if len(raw.shape) != 2:
            raise ExportError(f"{plan.src}: a quantized tensor of shape {tuple(raw.shape)} (GGUF takes 2-D ones)")
        if raw.shape[-1] % BLOCK:
            raise ExportError(f"{plan.src}: K = {raw.shape[-1]} is not a multiple of {BLOCK}: ggml's "
                              f"{GGML_TYPE_OF[raw.fmt]} blocks cannot hold it exactly")
        return GGML_TYPE_OF[raw.fmt]
    if raw.fmt not in quant.FLOAT_FORMATS:
        raise ExportError(f"{plan.src}: unknown format {raw.fmt!r}")
    return "F32" if plan.op else GGML_TYPE_OF[raw.fmt]


def gguf_array(raw, plan: Plan) -> tuple[np.ndarray, str]:
    """(array to write, ggml type name) of one planned tensor; quantized arrays are block bytes."""
    ggml_type(raw, plan)
    return _quant_array(raw, plan) if raw.fmt in quant.QSPEC else _float_array(raw, plan)


# ---- tokenizer ---------------------------------------------------------------------------------------------------


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    eos: int | None
    pad: int | None
    chat_template: str


def _pre_tokenizer(pre: dict | None) -> str:
    """llama.cpp's name for a byte-level tokenizer.json's pre-tokenizer; ExportError where it knows none."""
    if not pre:
        raise ExportError("tokenizer.json has no pre-tokenizer: llama.cpp would split text differently")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        split = [p for p in parts if p.get("type") == "Split"]
        byte = [p for p in parts if p.get("type") == "ByteLevel"]
        if len(parts) == 2 and len(split) == 1 and len(byte) == 1 and not byte[0].get("use_regex", True):
            regex = (split[0].get("pattern") or {}).get("Regex")
            if regex in KNOWN_SPLITS:
                return KNOWN_SPLITS[regex]
            raise ExportError(f"tokenizer.json splits with a regex llama.cpp does not know ({str(regex)[:60]}...): "
                              "its tokenization would differ")
    raise ExportError(f"tokenizer.json's pre-tokenizer {json.dumps(pre)[:80]} is not one llama.cpp reproduces")


def gguf_vocab(tokenizer, vocab_size: int) -> Vocab:
    """The GGUF vocabulary of an engine tokenizer (tokenizers' byte-level BPE, or the byte tokenizer), padded to
    the model's ``vocab_size`` with unused tokens."""
    from .tokenizer import BYTE_CHARS, ByteTokenizer

    normal, control, user, unused = 1, 3, 4, 5  # gguf.TokenType
    eos_ids = tuple(getattr(tokenizer, "eos_ids", ()) or ())
    template = getattr(tokenizer, "chat_template", "") or ""
    if isinstance(tokenizer, ByteTokenizer):
        tokens = list(BYTE_CHARS[:min(256, vocab_size)])
        types = [normal] * len(tokens)
        specials = sorted(tokenizer.specials.items(), key=lambda kv: kv[1])
        for tok, tid in specials:
            tokens.append(tok)
            types.append(control)
        merges, pre, pad = [], "default", None
    else:
        data = json.loads(tokenizer.backend.to_str())
        model = data.get("model") or {}
        if model.get("type") != "BPE" or model.get("byte_fallback"):
            raise ExportError(f"tokenizer.json's model is {model.get('type')!r}"
                              f"{' with byte fallback' if model.get('byte_fallback') else ''}: llama.cpp's gpt2 "
                              "vocabulary takes byte-level BPE")
        if data.get("normalizer"):
            raise ExportError(f"tokenizer.json has a normalizer ({data['normalizer'].get('type')}): "
                              "llama.cpp's gpt2 vocabulary has none")
        pre = _pre_tokenizer(data.get("pre_tokenizer"))
        by_id: dict[int, tuple[str, int]] = {i: (t, normal) for t, i in model["vocab"].items()}
        for added in data.get("added_tokens") or []:
            by_id[added["id"]] = (added["content"], control if added.get("special") else user)
        top = max(by_id) + 1
        if top > vocab_size:
            raise ExportError(f"the tokenizer has ids up to {top - 1}, beyond the model's {vocab_size} rows")
        tokens = [by_id.get(i, (f"[PAD{i}]", unused))[0] for i in range(top)]
        types = [by_id.get(i, (f"[PAD{i}]", unused))[1] for i in range(top)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        pad_tok = tokenizer.token_to_id("<|endoftext|>")
        pad = pad_tok
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(unused)
    return Vocab(tokens, types, merges, pre, eos_ids[0] if eos_ids else None, pad, template)


# ---- the file ----------------------------------------------------------------------------------------------------


def _rope_sections(half: int) -> list[int]:
    """Qwen3.5's interleaved M-RoPE sections (11, 11, 10 of 32 pairs) scaled to ``half`` rotary pairs. Text
    positions are equal in all three sections, so any split rotates text as plain RoPE does."""
    t = round(half * 11 / 32)
    h = round(half * 11 / 32)
    return [t, h, half - t - h, 0]


def export_gguf(loaded, out: str | os.PathLike, *, progress=None) -> ExportResult:
    """Write ``loaded``'s text decoder (a :class:`~.loader.LoadedModel`) to ``out`` as GGUF (atomically: a
    ``.partial`` file renamed at the end). ``progress(done_bytes, total_bytes, name)`` after each tensor."""
    import gguf

    cfg: ModelConfig = loaded.config
    if cfg.linear_layers and cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise ExportError(f"llama.cpp's qwen35 takes one GDN head size: linear_key_head_dim "
                          f"{cfg.linear_key_head_dim} != linear_value_head_dim {cfg.linear_value_head_dim}")
    if cfg.attention_bias:
        raise ExportError("attention biases: llama.cpp's qwen35 has none")
    raws = loaded.raws
    plans = tensor_plans(cfg, set(raws))
    vocab = gguf_vocab(loaded.tokenizer, cfg.vocab_size)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), ARCH)
    w.add_name(str(loaded.info.get("model_id") or loaded.info.get("preset") or out.stem))
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_rope_dimension_sections(_rope_sections(cfg.rotary_dim // 2))
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.value_dim)
    w.add_full_attention_interval(4)  # read only where recurrent_layers is absent
    w.add_array(f"{ARCH}.attention.recurrent_layers", [t != FULL for t in cfg.layer_types])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    # llama.cpp's gpt2 vocabulary needs a merges key and gguf writes no empty array: a vocabulary without merges
    # (the byte tokenizer's) gets one that can never apply (BPE symbols start as single characters and only merges
    # lengthen them)
    w.add_token_merges(vocab.merges or [f"{NO_MERGE} {NO_MERGE}"])
    if vocab.eos is not None:
        w.add_eos_token_id(vocab.eos)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)
    w.add_string("ninfer.source", json.dumps({k: v for k, v in loaded.info.items() if isinstance(v, (str, int, float,
                                                                                                      bool))},
                                             sort_keys=True))
    types: dict[str, int] = {}
    shapes = []
    for plan in plans:  # the tensor table first (sizes without the data), then the data a tensor at a time
        raw = raws[plan.src]
        kind = ggml_type(raw, plan)
        shape = (raw.shape[0], raw.shape[-1]) if plan.op == "squeeze_conv" else tuple(raw.shape)
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        bsize, tsize = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1])) * shape[-1] // bsize * tsize
        w.add_tensor_info(plan.dst, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        shapes.append((kind, nbytes))
        types[kind] = types.get(kind, 0) + 1
    total = sum(n for _, n in shapes)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for plan, (kind, nbytes) in zip(plans, shapes):
            arr, got = gguf_array(raws[plan.src], plan)
            if got != kind or arr.nbytes != nbytes:
                raise ExportError(f"{plan.src}: planned {kind} of {nbytes} bytes, made {got} of {arr.nbytes}")
            w.write_tensor_data(arr)
            done += nbytes
            if progress:
                progress(done, total, plan.dst)
        w.close()
        os.replace(tmp, out)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    skipped = []
    if cfg.mtp_num_hidden_layers:
        skipped.append("mtp (the MTP head)")
    skipped += [f"{k} (a drafter)" for k in sorted(getattr(loaded, "drafters", {}) or {})]
    if getattr(loaded, "vision", None):
        skipped.append("vision (the vision tower)")
    return ExportResult(str(out), len(plans), out.stat().st_size, types, skipped, vocab.pre)


def same_weights(loaded, path: str | os.PathLike) -> str | None:
    """Whether the GGUF file at ``path`` holds ``loaded``'s weights as :func:`export_gguf` writes them: None when
    it does, else why not. The tensor table must match the export's names, types and shapes, and three tensors (the
    first, one in the middle, the last) must match byte for byte (a file of other weights, e.g. a preset's seeded
    weights built on another device, differs in all of them)."""
    import gguf

    cfg = loaded.config
    plans = tensor_plans(cfg, set(loaded.raws))
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        return f"{path}: not a GGUF file ({e})"
    tensors = {t.name: t for t in reader.tensors}
    if set(tensors) != {p.dst for p in plans}:
        return f"{path}: its tensors are not those of this model's export"
    picks = {0, len(plans) // 2, len(plans) - 1}
    for i, plan in enumerate(plans):
        t = tensors[plan.dst]
        raw = loaded.raws[plan.src]
        try:
            want = ggml_type(raw, plan)
        except ExportError as e:
            return f"{path}: this model cannot be exported exactly ({e})"
        if t.tensor_type.name != want:
            return f"{path}: {plan.dst} is {t.tensor_type.name}, this model's export writes {want}"
        if i in picks:
            arr, _ = gguf_array(raw, plan)
            if arr.tobytes() != np.asarray(t.data).tobytes():
                return f"{path}: {plan.dst} holds other weights than this model's"
    return None

