"""Commands that run the engine directly: ``logits``, ``generate`` and ``serve``."""

from __future__ import annotations

import functools

import click

from .common import (UserError, build_engine, check_output, console, engine_options, err_console, int_list, on_ranks,
                     pack_prefill_option)


@click.command()
@click.argument("artifact")
@click.option("--text", default=None, help="Prompt text (tokenized with the artifact's tokenizer).")
@click.option("--ids", default=None, help="Comma-separated token ids.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where to write the [T, V] .npy.")
@engine_options(kv_default="fp32")
def logits(artifact, text, ids, out, **options):
    """Write the full-prefill logits [T, vocab] of a prompt to a .npy file."""
    import numpy as np

    if (text is None) == (ids is None):
        raise UserError("give exactly one of --text or --ids")
    prompt = int_list(ids, "--ids") if ids is not None else None
    check_output(out)
    eng = build_engine(artifact, **options)
    out_logits = eng.logits(prompt if prompt is not None else eng.tokenizer.encode(text)).numpy()
    bad_rows = np.flatnonzero(~np.isfinite(out_logits).all(axis=-1))
    if bad_rows.size:
        raise UserError(f"the logits of {bad_rows.size} of {len(out_logits)} positions (the first: {bad_rows[0]}) "
                        f"are not finite: the weights hold NaN / inf or the computation overflows; nothing written")
    with open(out, "wb") as f:  # np.save(path) would add .npy to a name without it
        np.save(f, out_logits)
    console.print(f"[green]wrote[/] {out}  shape {list(out_logits.shape)}  dtype {out_logits.dtype}")


@click.command()
@click.argument("artifact", required=False)
@click.option("--prompt", "-p", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user turn with the artifact's chat template.")
@click.option("--max-new-tokens", "-n", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image placed before the prompt text (repeatable; needs a model with a vision component).")
@click.option("--video", "videos", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A video before the prompt text: .npy / .npz frames or animated GIF / PNG / WebP (repeatable).")
@engine_options
def generate(artifact, prompt, prompt_file, chat, max_new_tokens, temperature, top_p, top_k, seed, stop, spec,
             draft_tokens, images, videos, **options):
    """Generate text from a prompt, optionally about images and videos (default model: the bundled one)."""
    from ..engine.media.prompt import placeholder
    from ..suites.common import read_text

    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt or --prompt-file")
    text = prompt if prompt is not None else read_text(prompt_file)
    eng = build_engine(artifact, spec=spec, draft_tokens=draft_tokens, **options)
    budget = eng.media_budget()  # all the prompt's items together
    items = [eng.load_media("image", p, budget) for p in images] + [eng.load_media("video", p, budget) for p in videos]
    text = "".join(placeholder(it.kind) for it in items) + text
    if chat:
        text = eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ids, media = eng.media_prompt(eng.tokenizer.encode(text), items)
    res = eng.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=seed, stop=stop, media=media)
    # the completion as generated: no wrapping at the console width, no :name: emoji codes replaced
    console.print(res.text, highlight=False, markup=False, emoji=False, soft_wrap=True)
    n = res.completion_tokens
    tok_s = f"{(n - 1) / res.decode_s:.1f}" if n > 1 and res.decode_s > 0 else "-"  # one token: no decode step
    extra = ""
    if res.spec.get("rounds"):
        extra = (f", {res.spec['tokens_per_round']:.2f} tokens/round, "
                 f"acceptance {res.spec['acceptance_rate']:.2f}")
    if res.vision:
        extra += f"; vision: {res.vision['tokens']} tokens encoded in {res.vision['encode_ms']:.1f} ms"
    err_console.print(f"[dim]{len(ids)} prompt + {n} tokens ({res.finish_reason}); ttft {res.ttft_s * 1e3:.1f} ms, "
                      f"decode {tok_s} tok/s{extra}[/]", highlight=False)


@click.command()
@click.argument("artifact", required=False)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8080, show_default=True, help="0 picks a free port (printed when ready).")
@click.option("--spec", type=click.Choice(["none", "mtp", "dflash", "dflash2"]), default="none", show_default=True)
@click.option("--draft-tokens", "-k", type=int, default=None, help="Draft tokens per round (default: MTP 3, DFlash 7).")
@click.option("--lm-head-draft", type=int, default=0, show_default=True,
              help="Drafters score only the N most frequent tokens (0: the full vocabulary).")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Requests that may wait for a slot; more get 503.")
@click.option("--session-capacity", type=int, default=16, show_default=True,
              help="Session states retained (least recently used are dropped).")
@click.option("--session-dir", type=click.Path(file_okay=False), default=None,
              help="Write session states here and restore them on start.")
@click.option("--media-dir", type=click.Path(file_okay=False), default=None,
              help="Let requests name image / video files (a path or file:// URL) inside this folder; "
                   "without it media must be sent as data URIs and no local file is read.")
@click.option("--interleave-chunk", type=int, default=512, show_default=True,
              help="Prompt tokens (of all admitting requests) prefilled per scheduler iteration while other "
                   "requests decode (at most --prefill-chunk): smaller lowers their inter-token latency, raises the "
                   "newcomers' TTFT.")
@pack_prefill_option
@click.option("--generation-config", type=click.Choice(["auto", "none"]), default="auto", show_default=True,
              help="auto: the model's generation_config.json sampling defaults (temperature, top_p, top_k) fill what "
                   "a request leaves out, as vLLM does; none: the APIs' own (temperature 1, top_p 1, no top-k).")
@click.option("--api-key", default=None, envvar="NINFER_BENCH_API_KEY",
              help="Every /v1/ route, /metrics, /tokenize and /detokenize want this key (Authorization: Bearer KEY, or x-api-key: KEY, as the official "
                   "clients send it); also read from NINFER_BENCH_API_KEY.")
@click.option("--insecure", is_flag=True, help="Serve beyond loopback (--host 0.0.0.0, ...) without an API key.")
@click.option("--allowed-hosts", default="", help="Comma-separated Host names served besides loopback's (a loopback "
                                                   "bind refuses other names: DNS rebinding).")
@click.option("--allowed-origins", default="", help="Comma-separated browser origins (https://app.example:3000, or "
                                                     "*) whose cross-origin requests are served; others are refused.")
@click.option("--tensor-parallel", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the engine over N ranks, one process each (as decode --tensor-parallel): rank 0 serves and "
                   "its scheduler drives the others; no sessions or image / video prompts under it yet.")
@engine_options
def serve(artifact, host, port, spec, draft_tokens, lm_head_draft, max_queue, session_capacity, session_dir,
          media_dir, generation_config, api_key, insecure, allowed_hosts, allowed_origins, tensor_parallel, **options):
    """Serve OpenAI- and Anthropic-style HTTP APIs (default: the bundled model on 127.0.0.1:8080)."""
    import importlib.util

    # the HTTP stack is the [serve] extra, not a core dependency: say so before the model loads, not in a traceback
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"serve needs {' and '.join(missing)} (the [serve] extra): pip install -e '.[serve]'")
    from ..engine.serve.app import ServerOptions
    from ..engine.serve.app import serve as run_server

    def names(text):
        return tuple(v.strip() for v in text.split(",") if v.strip())

    if tensor_parallel > 1 and (session_dir is not None or media_dir is not None):
        raise UserError(f"--tensor-parallel {tensor_parallel}: session states and image / video prompts are not "
                        "split over ranks yet: serve without --session-dir and --media-dir")
    server_opts = ServerOptions(host=host, port=port, max_queue=max_queue,
                                session_capacity=session_capacity if tensor_parallel == 1 else 0,
                                session_dir=session_dir, media_dir=media_dir, generation_config=generation_config,
                                api_key=api_key, insecure=insecure, allowed_hosts=names(allowed_hosts),
                                allowed_origins=names(allowed_origins))
    engine_args = dict(spec=spec, draft_tokens=draft_tokens, lm_head_draft=lm_head_draft,
                       tensor_parallel=tensor_parallel, **options)
    try:
        if tensor_parallel > 1:  # rank 0 serves; the others replay its scheduler's engine calls (mirror.py)
            on_ranks(tensor_parallel, _serve_ranked, (artifact, engine_args, server_opts), lambda r: r,
                     collective_timeout_s=SERVE_COLLECTIVE_TIMEOUT_S)
        else:
            eng = build_engine(artifact, **engine_args)
            run_server(eng, server_opts, on_ready=functools.partial(_ready, eng, session_dir, bool(api_key)))
    except KeyboardInterrupt:
        pass
    err_console.print("[dim]server stopped[/]")


SERVE_COLLECTIVE_TIMEOUT_S = 30 * 24 * 3600  # a rank waits this long for rank 0's next call (an idle server)


def _ready(eng, session_dir, keyed, url, backend, restored, problems) -> None:
    """The server's first line, once its socket listens."""
    from ..engine.serve.anthropic_api import MAX_TEMPERATURE

    for line in problems:
        err_console.print(f"[yellow]session file[/] {line}", highlight=False)
    o = eng.options
    spec_txt = f"spec {o.spec}" + (f" k={o.draft_tokens}" if o.spec != "none" else "")
    sessions = f", {restored} sessions restored" if session_dir else ""
    tp = f", tensor parallel {o.tensor_parallel} (no sessions)" if o.tensor_parallel > 1 else ""
    defaults = ", ".join(f"{k} {v}" for k, v in backend.sampling_defaults.items())
    if backend.sampling_defaults.get("temperature", 0) > MAX_TEMPERATURE:
        defaults += f" ({MAX_TEMPERATURE:g} on /v1/messages, whose requests may ask 0-{MAX_TEMPERATURE:g})"
    access = ", API key required" if keyed else ""
    console.print(f"[green]ready:[/] {url} (model {backend.model_id}, {o.max_concurrency} slots, {spec_txt}, "
                  f"kv {o.kv_dtype}, context {backend.context_limit}, {eng.device.type}{tp}{sessions}{access}"
                  f"{f'; sampling defaults from generation_config.json: {defaults}' if defaults else ''})",
                  highlight=False, soft_wrap=True)
    for line in backend.ignored_defaults:
        err_console.print(f"[yellow]generation_config.json[/] {line}: ignored", highlight=False)


def _serve_ranked(payload) -> list[list[int]]:
    """One rank of ``serve --tensor-parallel N``: rank 0 runs the server on a MirroredEngine, the others follow
    it; each returns the tokens of the sequences it released (compared across ranks when the server stops)."""
    from ..engine.runtime.mirror import lead_or_follow
    from ..engine.serve.app import serve as run_server

    artifact, engine_args, server_opts = payload
    eng = build_engine(artifact, **engine_args)

    def lead(mirror):
        try:
            run_server(mirror, server_opts, on_ready=functools.partial(_ready, eng, None,
                                                                       server_opts.api_key is not None))
        except KeyboardInterrupt:
            pass

    return lead_or_follow(eng, lead)[1]


COMMANDS = (logits, generate, serve)
