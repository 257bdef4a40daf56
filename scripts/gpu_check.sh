#!/usr/bin/env bash
# One device call: install the carried wheels, then run the named stages in order, each with its output under $OUT.
# Usage (repo root, on the GPU machine; carry [".whl"] for fla-core):
#   bash scripts/gpu_check.sh tests d27 niah conc27 vision kernels
#   bash scripts/gpu_check.sh train          # the bundled model (about 9 minutes: give it a call of its own)
#   STAGE_S=280 ENGINES=hf,ours RUNTIMES=v3,v2 ROLLBACKS=recompute [SPECS=none] [DRAFT_GRAPHS=off,on] \
#     [D27_ARGS="--silu-epilogue on,off --side-stream on,off"] bash scripts/gpu_check.sh d27
#   QBENCH_ARGS="--qmv-variants --ts 1 --fmts q4" bash scripts/gpu_check.sh qbench    # qmv launch sweep (+ --dense)
# Outputs: the device tool brings back only 8 files a call, so on exit every folder under $OUT becomes one .tar and the
# per-file test logs one tests_all.log; where that still leaves more than 8, everything goes into one all.tgz.
# Stages:
#   tests    CUDA tests, one process per file: engine on CUDA (graphs, fused path), every kernel against its reference
#   qtests   the quantized-projection tests only (qmv, Triton qlinear)
#   probe    scripts/probe_attention.py: attention launch shapes, each in its own process
#   qbench   scripts/bench_qlinear.py at the 27B projection shapes, T = 1, 4, 8 (QBENCH_ARGS adds flags)
#   kernels  bench_qlinear --quick, bench_attention --no-sweep, bench_fused, and the kernels suite at the 27B shape
#   tiny     decode on the tiny preset (v3, graphs) as a smoke test
#   d27      27B synthetic decode in one process (one weight build): none / MTP3 / DFlash2 K=7 x v3 / v2 x both
#            rollback strategies, and the transformers peer on the same weights (bf16, with fla if carried)
#   niah     the bundled model's NIAH grid, NIAH_GRID (8K-64K) x 0-100 % depth, --cudnn-prefill NIAH_CUDNN (off)
#   niahctx  the bundled model's NIAH at its native context (NIAH_CTX, default 131,072) x NIAH_DEPTHS: TTFT a case
#   conc27   27B synthetic concurrency C1-C8
#   conc33   issue 33's targets: 27B C1-C8 at 128 new tokens, plain and DFlash2 K=7 --replay-acceptance seed (CONC_ARGS)
#   lprefill layer-major prefill on / off: its CUDA test, the 27B prompt grid (PLEN, --prefill-weights LP_WEIGHTS)
#   cudnnp   --cudnn-prefill on,off: its tests, the attention bench (cudnn-split, --past), the 27B prompt grid
#   s62      session 62 in one call: the GDN prefill glue's, the chain link's and the chained decode's CUDA tests, the
#            glue bench, the 27B prompt grid (PLEN) with .old's tree and this one, the bundled model's plain held-out
#            decode with both trees, its decode step profiled (default and S62_GDN_BV state tiles), the README's main
#            command, scripts/probe_cudnn_plans.py (S62_PROBE=0 skips it), the bundled NIAH grid at S62_NIAH contexts;
#            S62_ENGINES=ours,hf adds the transformers peer to this tree's 27B grid (an H200: S62_GRID_S=400)
#   verify62 session 62's pieces not yet run on a GPU after its review (captured-prefill tests, conv_state_update's
#            window kernel, the GDN decode and chained-decode CUDA tests), then the bundled decode step's profile
#   gdnglue  a GDN prompt chunk's glue in fewer launches (conv_state_update, gates, the conv without layout
#            conversions): its CUDA tests, bench_gdn_prefill (GLUE_BT conv builds, beside .old's module when carried),
#            the 27B prompt grid (PLEN) with .old's tree (carried) and this one, ours only
#   cudnn16  the cuDNN split in fp16: the prefill attention's CUDA tests, the bundled NIAH grid with it on, the 27B
#            prompt grid (PLEN) with it on / off (CUDNNP_ENGINES)
#   ppast    bench_prefill_attention --past: a chunk against its past keys alone, ours beside torch SDPA's cuDNN / flash
#   ptma     the prefill attention through tensor descriptors: its CUDA tests, the kernel with / without them after
#            PTMA_STARTS keys, the 27B prompt-length grid (PLEN, ours and the peer), ours again with pointer loads
#   sdpa     scripts/probe_sdpa.py: torch SDPA's first call at each new key length, per backend (seconds)
#   dattn    a block drafter's attention read in place: its CUDA tests, the 27B DFlash2 round's profile at replayed
#            acceptance and the 27B replay grid, each with --draft-attention on / off
#   dattn2   the draft attention's ranges against the torch path, its tests, token invariance at NINFER_BENCH_ATTN_MIN_STEPS
#            = ATTN_MS, the 27B step / DFlash2 round profile for each MIN_STEPS_LIST value
#   dattn3   the 27B replay grid and the bundled model's held-out prompts with --draft-attention on / off, the draft
#            attention's bench, the README's main command
#   dattn4   the 27B replay grid (32K draft head) and the chained rounds' CUDA tests
#   ring31   issue 31 after the DFlash2 ring fix: the bundled held-out grid, the README's main command, dattn4's runs
#   grid31   the installed artifact's held-out grid (plain / MTP3 / DFlash2 K=7, 256 tokens, two repeats), the README's
#            main command and the chained rounds' CUDA tests (TESTS_S, default 300 s: seven tests, three took 60-90 s)
#   selfdraft the DFlash2 drafter retrained on mixed self-generated rows (retrain_drafters.py --data mix; SELF_SEQS,
#            SELF_BATCH, SELF_GEN_MIN, REDRAFT_MIN, REDRAFT_ARGS), before / after on the held-out prompts, the
#            artifact in parts; SELF_GRID=1 then runs the new artifact's held-out grid (plain / MTP3 / DFlash2 K=7,
#            256 tokens, two repeats) and the README's main command on it
#   profile  scripts/profile_step.py at the 27B shape: every kernel of 32 decode steps (PROFILE_ARGS adds flags)
#   vattn    where a verify's int8 decode attention goes (issue 32): scripts/probe_verify_attention.py at 65,536 keys,
#            split pass / combine / whole call for T = 1 and 8 (mma, wgmma) at the default plan and VATTN_SPLITS
#            (128,64,32) splits, then Nsight Compute (full set) on one launch of each kernel at the default plan
#   vattnab  a change to the decode attention's kernels against the tree before (.old, carried: `git archive REV |
#            tar -x -C .old`): their token-invariance / reference / wgmma-bits / Triton-agreement CUDA tests (VATTNAB_K
#            selects), then probe_verify_attention.py (VATTNAB_KERNELS, default mma; the default plan; VATTNAB_TAIL
#            lines shown) with this tree and .old's alternately VATTNAB_ROUNDS (2) times, then the bundled held-out
#            prompts (plain, DFlash2 K=7; 256 tokens, one repeat) for the token hashes
#   ipc      the tensor-parallel IPC collectives on one GPU: scripts/bench_ipc_collectives.py (two ranks' regions in one
#            process), then the 27B synthetic at TP = 2 (two ranks sharing the GPU: memory and tokens, not speed) with
#            plain / DFlash2 K=7 (IPC_N tokens)
#   ksuite   the kernels suite alone at the 27B shape, T = 1 and 8, with the captured decode step's timeline
#            (KSUITE_OPS: only these ops)
#   tilecheck scripts/probe_tile_bits.py, then test_cuda_engine's verify-row, speculative, block-draft and dflash2 PDL
#            tests with tracebacks
#   tpw      wide qmv launches with TPW row tiles a block: CUDA tests, 27B shapes at 64 rows, DFlash2 C8 with / without
#   s64      qmv's fp32 store (the logits with no copy kernel after the lm_head), the first norm with the embedding
#            lookup in one launch, the greedy chain's link launched under PDL: their CUDA tests (S64_TESTS=link:
#            the link's and the chained decode's only), S64_REPEATS rounds of profiles (.old's, this tree's, and
#            with S64_CAP=N this tree's with NINFER_BENCH_QMV_SPLIT_CAP=N, which also runs the held-out plain decode), the bundled decode step's profile (PROF_SPECS: none,dflash2:7)
#            and held-out prompts (S64_SPECS: none,dflash2:7, 256 tokens, two repeats) with this tree and .old's
#            (carried: the tree before), the README's main command
#   s64b     qmv's split-K reduced in a thread-block cluster: its CUDA tests and the chained decode's, then the bundled
#            decode step's profile (S64B_REPEATS rounds) and held-out prompts (plain, DFlash2 K=7) for each of
#            S64B_VARIANTS (default: "new" this tree, "ws" this tree with NINFER_BENCH_QMV_CLUSTER=0), the README's
#            main command
#   s65      a split launch's pieces walked in one block (qmv pieces, the split's bits): its CUDA tests and those of
#            the pieces session 64's review reshaped (the cluster store, the fp32 / silu dispatch, the one-program
#            link), scripts/probe_qmv_pieces.py on the bundled shapes and (PIECES_GRID=1, the default) the
#            calibration grid, then the bundled decode step's profile (S65_REPEATS rounds) for each S65_VARIANTS
#            (default: "new" this tree, "nopieces" NINFER_BENCH_QMV_PIECES=0, "cap1" NINFER_BENCH_QMV_SPLIT_CAP=1);
#            S65_K: the qmv tests' -k, S65_ENGINE_TESTS=0 skips the link's and the chained decode's, PIECES_GRID_ARGS
#   s65b     the bundled held-out prompts (plain, DFlash2 K=7) for each S65B_VARIANTS (default "new nopieces"), the
#            README's main command, and with S65_27B=1 the 27B synthetic decode (64 tokens) for each variant
#   s65c     a PDL launch's warps of fewer steps than a batch load them all before the wait (qmv steps FEW): the
#            qmv tests that cover it, the bundled decode step's profile with .old's tree (carried) and this one,
#            alternating S65C_REPEATS times, their held-out prompts (plain, DFlash2 K=7), the README's main command
#   ring     qmv with the weights streamed through a cp.async ring (stages): its CUDA tests, the 27B shapes at 64 rows
#            (RING_KNOBS) and, with RING_T=1, at 1 and 8 rows (RING_KNOBS1); RING_C8=1 adds the 27B DFlash2 K=7 replayed
#            C8 with each RING_WIDE build (label|NINFER_BENCH_QMV_WIDE) and plain C8
#   ncuqmv   Nsight Compute on wide qmv launches (NCU_QMV op:fmt:rows cases, NCU_QMV_KNOBS builds): why 64 rows cost
#            4-5x what 8 rows do
#   fp16b    the cuDNN split in fp16 with the weights vouching for its range (no host read a chunk and layer): its
#            CUDA tests, the 27B prompt grid (PLEN) --cudnn-prefill on,off with this tree, on with .old's (carried);
#            the split's profile is pprof's: PPROF_MODES=cudnn PPROF_ARGS="--by-op 20 --gaps 8"
#   chunks   the 27B prompt grid (PLEN) at each --prefill-chunk of CHUNKS (default 2048 4096 8192), one process
#            (CHUNK_ENGINES: add hf for the peer in the same process); a profile at each is pprof's, e.g.
#            PPROF_LEN=2991 PPROF_MODES="chunk2048 chunk4096" PPROF_ARGS="--by-op 30 --gaps 12"
#   pgemm    scripts/bench_prefill_gemm.py at the 27B shape: the stack's projection GEMMs alone at each row count (an
#            isolated rate: 2,048-row blocks it favoured measured slower inside the engine, docs/perf 2026-12-07c)
#   tp1gpu   tensor parallelism's CUDA path on one GPU (two gloo ranks sharing it) against one rank: 27B decode (v2,
#            plain and MTP3) and the tiny preset's concurrency, tokens compared
#   prof8    profile_step --batch 1,8 --sync at the 27B shape, plain and DFlash2 K=7: where a C8 round goes
#   sampled  the step sampler: its CUDA tests, scripts/probe_sampler.py (and .old's, carried), the 27B plain / sampled
#            concurrency at C1 and C8 (and .old's sampled C8)
#   main     the README's main command (bundled model, DFlash2 K=7 beside plain)
#   bundled  the bundled model: decode grid (none / MTP3 / DFlash2 K=7 x v3 / v2, and the peer), C1-C8, kernels
#   pack     issue 33's packed admissions: their tests, then the 27B C1-C8 workload with --pack-prefill on (plain, and
#            DFlash2 K=7 replayed), at C1 / C8 off, sampled (t 0.7, top-p 0.95, top-k 20), and .old's (carried) plain
#   conc33s  issue 33's targets with the defaults: sampler / packed-prefill CUDA tests, the 27B C1-C8 plain and DFlash2
#            K=7 replayed, sampled C1 / C8, the bundled model's C8 with --pack-prefill on, the 27B step's kernels at
#            1 and 8 sequences (profile_step --batch 1,8 --sync)
#   vision   the vision tower at the real shape next to transformers'
#   smoke    minutes-long first look: the training pipeline --tiny on CUDA, a 27B synthetic DFlash2 K=7 decode
#   train    scripts/train_bundled.py --stage all --ship $OUT
#   redraft  scripts/retrain_drafters.py: the bundled drafters trained REDRAFT_MIN (5.5) more minutes on the shipped
#            target, before / after acceptance, the new artifact in parts (back here: retrain_drafters.py join $OUT);
#            REDRAFT_ARGS adds flags (e.g. "--labels path --kinds dflash2 --blocks 4,8,12,8,16,8")
#   specprobe scripts/probe_spec_paths.py on the bundled model: MTP3 and DFlash2 K=7, drafting captured / eager x PDL
#   chain    chained speculative rounds (spec/chain.py) against the synchronous rounds: their CUDA tests, the bundled
#            model's held-out prompts and the 27B replay grid with --lookahead on,off, the README's main command, and
#            scripts/profile_step.py on the bundled model's rounds (chained and --sync)
#   glue     the drafters' fused glue (norms, q / k norm + rotation, fused q | k | v and gate | up, one attention mask a
#            block, kernels/select.py's top-k and walk) and the round's integer kernels (kernels/spec_round.py): their
#            CUDA tests, the bundled held-out prompts with this tree and with a copy of the tree before in .old
#            (`git archive REV | tar -x -C .old`, carried), the rounds' kernel profile, the 27B replay grid, the
#            README's main command
#   commit   every GDN layer's rollback in one launch (gdn_commit) and the drafters' head over --lm-head-draft
#            tokens: their CUDA tests, the 27B replay grid (head 0 / 32768 x recompute / snapshot) with this tree and
#            the tree before in .old (carried, as for glue), the 27B rounds' profile (head PROF_HEAD, 32768)
#   commitb  the same on the bundled model (rest of the CUDA tests, held-out prompts new / .old, the rounds'
#            profile), a short 27B DFlash2 grid (head 0 / 32768) and the README's main command
#   spec     speculative decoding as measured for the release: the 27B synthetic plain / MTP3 / DFlash2 K=7 grid at
#            replayed acceptance (seed: the release's tokens per round), the README's main command, and the bundled
#            model's plain / MTP3 / DFlash2 K=7 on its held-out prompts (SPEC_N tokens, default 128)
#   convert27 a 27B-shaped FP8 checkpoint (transformers, random weights) converted, verified, inspected and decoded
#            beside the synthetic 27B, with each step's wall time and peak RSS (about 8 minutes)
#   dattn    scripts/bench_attention.py with its launch sweep (DATTN_BUDGET_S, default 150 s): decode / verify attention
#            at the 27B shape, tokens packed in one tile and one token a tile, beside SDPA on a bf16 copy
#   ncuattn  Nsight Compute (full sections) on decode attention's split kernel, int8 beside bf16 at 65,536 keys
#            (NCU_CASES, NCU_COUNT, NCU_KERNEL): where the int8 path loses to bf16, or (NCU_KERNEL='^attn_verify$')
#            where the CUDA kernel's verify blocks spend their steps; the reports come back in ncu.tar
#   pattn    prefill attention: its CUDA tests, then scripts/bench_prefill_attention.py (--sweep int8; PATTN_ARGS)
#   ptests   the engine's prefill paths on CUDA: test_fastpath, test_prefill_graphs, test_sampler, test_cuda_engine,
#            the GDN prefill glue and prefill attention kernels
#   pprof    scripts/profile_step.py --prefill at PPROF_LEN (65000) tokens on the 27B synthetic, per PPROF_MODES
#            (flash sdpa; flash: the defaults, fused prefill on; also unfused: --no-fused-prefill, dense / packed:
#            --prefill-weights dense / packed): every kernel of one long prefill (about 75 s a mode)
#   llamabuild llama-cpp-python built with CUDA (sm_90) from the carried trimmed source (.peer/llama-src.tgz, made
#            by scripts/pack_llama_src.sh) into /tmp/llsite, in the background (setsid: it outlives the call while the
#            machine stays warm; /tmp/llbuild.log, /tmp/llbuild.rc); LLBUILD_WAIT=1 waits for it
#   peer27   the 27B synthetic exported to GGUF (during llamabuild's build), then (once built) ours beside llama.cpp
#            (CUDA) on it, PEER_N (128) tokens at 8K context; PEER65K=1 adds one 65,000-token prompt with 16 tokens;
#            LLBUILD_ARGS adds CMake flags to llamabuild (-DGGML_CUDA_FA=OFF: about 40% fewer CUDA files)
#            export27 writes only the export, peer27 keeps /tmp/q27.gguf when an earlier call of a warm machine
#            wrote it; PEER8K=0 skips the 8K run; llwait waits for the build (split a build + 65K over two calls:
#            `llamabuild export27 llwait`, then at once `PEER8K=0 PEER65K=1 ... peer27`)
#   pgraphs  prefill CUDA graphs: tests/test_prefill_graphs.py, test_sampler.py, test_cuda_engine.py, then the 27B
#            synthetic decode with --prefill-graphs on,off (prefill tok/s, TTFT and tokens of each)
#   plen27   decode -p PLEN (2991,65000) on the 27B synthetic, ours and the transformers peer (PLEN_ENGINES), PLEN_N
#            (128) tokens (PLEN_ARGS adds flags): each length's prefill tok/s, TTFT and the decode after it; about
#            6 minutes with the peer at 65K (its bf16 load and three 65K prefills): give it STAGE_S >= 420
#   pweights the 27B synthetic decode with --prefill-weights auto (dense copies on an H200) and packed, then C1 / C8
#            with dense
#   ctx262   decode -p 262016 -n 128 on the 27B synthetic: the native context's prefill and decode on one GPU
#   phead    the final prefill chunk's in-graph first token: test_prefill_graphs and test_cuda_engine, then
#            probe_prefill_drift (DRIFT_RUNS 12 fresh-Engine runs) with this tree and with .old's (carried)
#   drift    scripts/probe_prefill_drift.py: the bundled model's prefill time between runs (fresh / shared Engine,
#            GC off), DRIFT_RUNS (40) runs of 5 repeats a condition
#   peersmall (waits for llamabuild) the bundled model beside llama.cpp (CUDA) on the 64 held-out prompts, 64 tokens
#   gtrust   scripts/gate_trust.py on the bundled model (issue 34): GT_PAIRS (100) A/A pairs of 5 repeats, GT_INJ (40)
#            pairs against a 5% injected slowdown with --repeats auto (a plain settle run after each delayed run), no
#            pair started past GT_LIMIT_S (300) seconds (93 pairs took 169 s with the start on an H200)
#   rows     qmv over 9-64 rows in one launch (issues 33 / 38): its CUDA tests, scripts/bench_qlinear.py at T = ROWS_TS
#            (16,64) with 8 / 16 / 32 / 64 rows a launch and the knobs ROWS_KNOBS (every width's bits against 8 a
#            launch), then (unless ROWS_CONC=0) the 27B C1 / C8 DFlash2 K=7 replayed and plain C8, and .old's
#            (carried) DFlash2 C8
#   rowsconc the wide qmv launches and the captured sampler end to end: their CUDA tests, then the 27B (256-token
#            prompts, 128 tokens) plain C1 / C8, DFlash2 K=7 replayed C1-C8, sampled (t 0.7, top-p 0.95, top-k 20) C1 / C8
#   sampler  scripts/probe_sampler.py: the step sampler eager against its captured graph, 1 and 8 rows of 248K logits
#   cattn    the tensor-core int8 decode attention (kernels/attn_cuda.cu): its CUDA tests, the Triton attention tests
#            and the engine's (in parallel), then scripts/bench_attention.py with its sweep (CATTN_BUDGET_S, 100 s):
#            the CUDA kernel (attn_split at T = 1, attn_verify above) beside the Triton one at 8K / 65K keys,
#            T = 1 / 8, B = 1 / 8
#   wgv      the verify attention on wgmma (attn_verify_wg): its CUDA tests, the int8 cases with each verify kernel
#   cattn27  decode -p CATTN_P (2991,65000) -n 128 on the 27B synthetic with the CUDA attention (the default) and with
#            NINFER_BENCH_ATTN=triton, ours only: decode after a long prompt against a short one, either kernel
#   l2flush  the kernels suite's L2 flush (read, the default, against write): scripts/probe_l2_flush.py's timings
#            (L2F_OPS at L2F_ROWS rows), then under Nsight Compute (--cache-control none) each launch's DRAM bytes read
#            and written after either flush, then the kernels suite at the 27B shape (v3, T = 1 and 8) with
#            --l2-flush write and read (KSUITE_OPS: only these ops), the second with the step's timeline
#   b38      issue 38's measurements on this GPU in one call: the bundled held-out prompts (plain, DFlash2 K=7), the
#            bundled decode step's profile with the defaults and with each B38_DROPS set (--drop, default norm)
#            alternating B38_REPEATS (2) times, the 27B synthetic plain decode (64 tokens); name ksuite after it for
#            the kernels suite with the captured step's timeline
#   qshape   per-shape qmv launch overrides (warps a tile, split-K count, blocks an SM: QSHAPE_SPECS) at the 27B step's
#            projection shapes, T = 1 and 8, chained under PDL (bench_qlinear --shape-knobs --pdl); the wins
#            scripts/pick_qmv_shapes.py keeps, then (QSHAPE_E2E=1, the default) the 27B synthetic plain decode with the
#            defaults and with them (NINFER_BENCH_QMV_SHAPES), alternating QSHAPE_ROUNDS (1) times
#   hashes   the token hashes a refactor must keep: the README's main command (timed), the bundled model's plain and
#            MTP3 runs, and the 27B synthetic plain / MTP3 / DFlash2 K=7 runs (64 tokens, the default prompt)
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# STAGE_S bounds each stage's main command (use it rather than an outer `timeout`: that kills this script before it
# folds its outputs, and can leave the command running on)
nb() { timeout "${STAGE_S:-86400}" python3 scripts/nb.py "$@"; }
# the bundled model's held-out prompts (plain, MTP3, DFlash2 K=7) with this tree, then, when .old holds a copy of the
# tree before (carried), with that one in the same call: $OUT/$1 and $OUT/$1_old
HELD="--prompt-file suites/data/heldout_prompts.jsonl -n 256 --repeats 2"
held_pair() {
  nb decode --spec none,mtp:3,dflash2:7 $HELD --json "$OUT/$1" 2>&1 | tee "$OUT/$1.log" | tail -8
  if [ -d .old ]; then ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
    ( cd .old && timeout "${STAGE_S:-300}" python3 scripts/nb.py decode --spec none,mtp:3,dflash2:7 $HELD \
        --json "$OUT/$1_old" 2>&1 | tee "$OUT/$1_old.log" | tail -8 ); fi
}
pack() {  # the device tool returns only a handful of files a call: one archive per folder, one log for the tests
  ( cd "$OUT" || exit 0
    for d in */; do [ -d "$d" ] && tar -cf "${d%/}.tar" "$d" && rm -rf "$d"; done
    if ls test_*.log >/dev/null 2>&1; then
      for f in test_*.log; do echo "=== $f"; cat "$f"; done > tests_all.log && rm -f test_*.log
    fi
    # more entries than the tool returns (8): all of them in one archive where it fits the tool's 16 MiB a file
    if [ "$(ls -1A | wc -l)" -gt 8 ]; then
      local a; a=$(mktemp -d)/all.tgz
      tar -czf "$a" . && if [ "$(stat -c %s "$a")" -le $((16 << 20)) ]; then
        find . -mindepth 1 -maxdepth 1 -exec rm -rf {} + && mv "$a" .; else rm -f "$a"; fi
    fi )
}
# the bundled model's held-out grid (plain, MTP3, DFlash2 K=7) and the README's main command on the artifact $2
# (default: the installed one): $OUT/specb$1, $OUT/main$1.json
held_main() {
  local M=${2:+--model $2}
  nb decode $M --spec none,mtp:3,dflash2:7 $HELD --json "$OUT/specb$1" 2>&1 | tee "$OUT/specb$1.log" | tail -7
  nb decode $M --spec dflash2 -k 7 --json "$OUT/main$1.json" 2>&1 | tee "$OUT/main$1.log" | tail -6
}
ring_bench() {  # the ring stage's bench: bench_qlinear at the 27B q4 and q5 shapes and "$3" ("q8|lm_head" or
  # empty), one process a format, the rest of the arguments its flags; each line to $OUT/$1/$2, ours / qmv rows printed
  local dir=$1 log=$2 extra=$3 FO; shift 3
  for FO in "q4|mlp.gate_up,mlp.down,gdn.qkv,gdn.out" "q5|attn.q_gate,attn.o" $extra; do
    OUT=$OUT/$dir timeout ${QBENCH_S:-150} python3 scripts/bench_qlinear.py --no-baselines "$@" --fmts ${FO%%|*} \
      --ops ${FO#*|} 2>&1 | tee -a "$OUT/$dir/$log" | grep -v "@graph20" | grep -E "ours|qmv|FAIL|DIFFER|copy bandwidth"
  done
}
c8_builds() {  # the 27B DFlash2 K=7 replayed C8 with each build "label|QMV_WIDE" (the value of NINFER_BENCH_QMV_WIDE;
  # the arguments after the folder $1), then plain C8 (C8_PLAIN=0 skips it); logs and JSON into $OUT/$1, E2E_S seconds
  # each (a fresh machine's first DFlash2 run spent 129 s compiling before its first request finished)
  local dir=$1 V N R C27="$M27 -n 128 --rounds 2"; shift
  for V in "$@"; do N=${V%%|*}; R=${V#*|}; echo "--- dflash2 C8 $N"
    NINFER_BENCH_QMV_WIDE="$R" timeout ${E2E_S:-280} \
      python3 scripts/nb.py concurrency $C27 -c 8 --spec dflash2 -k 7 --replay-acceptance seed \
      --json "$OUT/$dir/dflash2-$N.json" 2>&1 \
      | tee "$OUT/$dir/dflash2-$N.log" | grep -E "^│|rror|sequential p0" | head -6; done
  [ "${C8_PLAIN:-1}" = 0 ] && return
  echo "--- plain C8"; timeout ${E2E_S:-280} python3 scripts/nb.py concurrency $C27 -c 8 \
    --json "$OUT/$dir/plain.json" 2>&1 | tee "$OUT/$dir/plain.log" | grep -E "^│|rror" | head -4
}
bg_test() {  # tests/$1.py -k "$2" in the background (TESTS_S seconds, default 200), its log $OUT/$1.log ending in
  # pytest's rc; bg_report names the logs to print once they are done (after `wait`)
  ( timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/$1.py -k "$2" > "$OUT/$1.log" 2>&1
    echo "pytest rc $?" >> "$OUT/$1.log" ) &
}
bg_report() {
  local f
  for f in "$@"; do echo "--- $f: $(tail -1 "$OUT/$f.log")"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -6; done
}
chained_tests() {  # the chained speculative rounds' CUDA tests (seven; three took 60-90 s)
  timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py -k chained \
    > "$OUT/chained_tests.log" 2>&1; echo "pytest rc $?"; tail -3 "$OUT/chained_tests.log"
}
trap pack EXIT
qmv_env() {  # a qmv variant's environment (s64b, s65, s65b): ws (the split's workspace, no cluster), nopieces (split
  # launches spread over blocks), capN (splits capped at N), else none of qmv's switches
  case $1 in ws) echo NINFER_BENCH_QMV_CLUSTER=0;; nopieces) echo NINFER_BENCH_QMV_PIECES=0;;
             cap*) echo NINFER_BENCH_QMV_SPLIT_CAP=${1#cap};; *) echo QMV_VARIANT=$1;; esac
}
held_variants() {  # the bundled held-out prompts with the specs $1 for each qmv variant named after it (qmv_env)
  local specs=$1 v; shift
  for v in "$@"; do
    env $(qmv_env $v) timeout ${STAGE_S:-200} python3 scripts/nb.py decode --spec $specs $HELD \
      --json "$OUT/held-$v" > "$OUT/held-$v.log" 2>&1
    echo "--- bundled held-out, $v: rc $?"; grep -E "│ v3-|decode tok/s|tokens sha256" "$OUT/held-$v.log"; done
}
llwait() {  # wait for the llamabuild stage's background build (LLWAIT_S seconds at most); 0 when it succeeded
  local t=0
  while [ ! -f /tmp/llbuild.rc ] && [ $t -lt "${LLWAIT_S:-560}" ]; do sleep 5; t=$((t + 5)); done
  if [ ! -f /tmp/llbuild.rc ]; then echo "llama.cpp build still running after ${t} s: $(grep -c '^\s*\[' /tmp/llbuild.log) steps"
    tail -c 600 /tmp/llbuild.log; return 1; fi
  read -r rc secs < /tmp/llbuild.rc; echo "llama.cpp build: rc $rc in $secs s"
  [ "$rc" = 0 ] || { grep -E "error|Error" /tmp/llbuild.log | head -20; tail -c 1500 /tmp/llbuild.log; cp /tmp/llbuild.log "$OUT/"; }
  [ "$rc" = 0 ]
}
run_tests() {  # the named test files on CUDA, one process each, all at once; each log ends with pytest's rc (the
  # device's pytest prints no count line)
  local f
  for f in "$@"; do
    ( timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider --durations=3 tests/$f.py > "$OUT/$f.log" 2>&1
      echo "pytest rc $?" >> "$OUT/$f.log" ) &
  done
  wait
  for f in "$@"; do
    echo "--- $f: $(tail -1 "$OUT/$f.log")"; grep -E "^(FAILED|ERROR)" "$OUT/$f.log" | head -8
  done
  echo "tests done $(date +%T)"
}
git log -1 --format='commit %H' 2>/dev/null || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
M27="--model qwen3.8-27b --synthetic"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)   # one process per file, all at once (correctness only, no timing): a kernel fault poisons its own
             # CUDA context, not the other files
             run_tests ${TEST_FILES:-test_kernels_qmv_cuda test_kernels_qlinear test_kernels_fused test_kernels_attention \
                      test_kernels_gdn_triton test_kernels_gdn test_fastpath test_cuda_engine test_suite_kernels test_sampler} ;;
    qtests)  timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_qmv_cuda.py \
               tests/test_kernels_qlinear.py 2>&1 | tee "$OUT/qtests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | head -20 ;;
    probe)   timeout ${PROBE_S:-240} python3 scripts/probe_attention.py 2>&1 | tee "$OUT/probe_attention.log" | tail -40 ;;
    qbench)  OUT=$OUT timeout ${QBENCH_S:-300} python3 scripts/bench_qlinear.py --no-baselines --ts 1,4,8 \
               --ops attn.q_gate,attn.o,gdn.qkv,gdn.out,mlp.gate_up,mlp.down,lm_head ${QBENCH_ARGS:-} 2>&1 \
               | tee "$OUT/qbench.log" | grep -v "@graph20" | tail -80 ;;
    kernels) python3 scripts/bench_qlinear.py --quick 2>&1 | tee "$OUT/qlinear.log" | tail -30
             python3 scripts/bench_attention.py --no-sweep 2>&1 | tee "$OUT/attention.log" | tail -15
             python3 scripts/bench_fused.py --gdn-only 2>&1 | tee "$OUT/fused.log" | tail -15
             nb kernels --shape qwen3.8-27b --t 1,8 --repeats 30 --json "$OUT/kernels_27b.json" 2>&1 | tail -12 ;;
    tiny)    timeout 90 python3 scripts/nb.py decode --model tiny -n 256 --repeats 2 --json "$OUT/tiny_v3.json" 2>&1 | tail -20 ;;
    d27)     nb decode $M27 --engine ${ENGINES:-ours,hf} --spec ${SPECS:-none,mtp:3,dflash2:7} --runtime ${RUNTIMES:-v3,v2} \
               --rollback ${ROLLBACKS:-recompute,snapshot} --draft-graphs ${DRAFT_GRAPHS:-on} --pdl ${PDLS:-on} \
               -n 64 --repeats 2 ${D27_ARGS:-} --json "$OUT/d27" 2>&1 | tee "$OUT/d27.log" | tail -40 ;;
    profile) for mode in ${PROFILE_MODES:-lookahead sync}; do  # 27B decode steps (or rounds, or one prefill), each
             # mode one switch against the engine's defaults (lookahead: the defaults themselves)
               case $mode in
                 sync)          flags="--sync" ;;                     # read each token before the next step
                 nopdl)         flags="--no-pdl" ;;                   # the step's kernels without programmatic dependent launch
                 noside)        flags="--no-side-stream" ;;           # the GDN b / a and z projections in the main chain
                 nosilu)        flags="--no-silu-epilogue" ;;         # the MLP's silu(gate) * up by its own kernel
                 cublas)        flags="--cublas-dense" ;;             # small dense projections by cuBLAS
                 rows|tiled)    flags="--qmv-layout $mode" ;;         # packed weights row-major / in TILED 1
                 attnfixed)     flags="--attn-fixed-split" ;;         # attention split as for the full cache
                 prefill)       flags="--prefill --prompt-len 818" ;; # one 818-token prefill
                 mtp)           flags="--spec mtp -k 3" ;;            # MTP3 rounds (captured drafting)
                 mtpeager)      flags="--spec mtp -k 3 --eager-draft" ;;
                 dflash2)       flags="--spec dflash2 -k 7" ;;        # DFlash2 K=7 rounds (captured drafting)
                 dflash2eager)  flags="--spec dflash2 -k 7 --eager-draft" ;;
                 lookahead)     flags="" ;;
                 gdnbv-*)       flags="--gdn-block-v ${mode#gdnbv-}" ;;  # GDN state tile width (128: norm fused)
                 drop-*)        m=${mode#drop-}; flags="--drop ${m//+/,}" ;;  # headroom: without those launches
                                                                      # (drop-norm+silu: --drop norm,silu)
                 *)             echo "profile: unknown mode $mode" >&2; continue ;;
               esac
               timeout ${STAGE_S:-400} python3 scripts/profile_step.py $M27 --steps 32 $flags ${PROFILE_ARGS:-} \
                 --json "$OUT/profile27_$mode.json" 2>&1 | tee "$OUT/profile27_$mode.log" | tail -${PROFILE_LINES:-30}
             done ;;
    sdpa)    timeout ${STAGE_S:-120} python3 scripts/probe_sdpa.py 2>&1 | tee "$OUT/probe_sdpa.log" | tail -12 ;;
    vattn)   mkdir -p "$OUT/vattn"
             timeout ${STAGE_S:-300} python3 scripts/probe_verify_attention.py --splits ${VATTN_SPLITS:-128,64,32} \
               --json "$OUT/vattn/probe.json" 2>&1 | tee "$OUT/vattn/probe.log" | tail -30
             if command -v ncu >/dev/null; then
               timeout ${STAGE_S:-300} ncu --profile-from-start off --set full -k 'regex:attn_split|attn_verify|_attn_combine' \
                 -o "$OUT/vattn/v" python3 scripts/probe_verify_attention.py --profile > "$OUT/vattn/ncu.log" 2>&1
               echo "--- ncu rc $?"; grep -E "^==PROF==.*(rror|arning)|Error|profiled" "$OUT/vattn/ncu.log" | head -8
               ncu --import "$OUT/vattn/v.ncu-rep" --page details --print-units base > "$OUT/vattn/details.txt" 2>&1
               grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Executed Ipc A" \
                 "$OUT/vattn/details.txt" | head -80
               gzip -f "$OUT/vattn/details.txt"; rm -f "$OUT/vattn/v.ncu-rep"
             fi ;;
    vattnab) mkdir -p "$OUT/vattnab"
             timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_kernels_attn_cuda.py \
               -k "${VATTNAB_K:-tokens_and_rows or rows_a_verify or matches_reference or wgmma or triton_kernel}" \
               > "$OUT/vattnab/tests.log" 2>&1
             echo "--- attention tests: rc $?"; tail -3 "$OUT/vattnab/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/vattnab/tests.log" | head
             for r in $(seq ${VATTNAB_ROUNDS:-2}); do
               timeout 120 python3 scripts/probe_verify_attention.py --kernels ${VATTNAB_KERNELS:-mma} \
                 --json "$OUT/vattnab/new$r.json" 2>&1 | tail -${VATTNAB_TAIL:-4}
               [ -d .old ] && ( cd .old && timeout 120 python3 scripts/probe_verify_attention.py \
                 --kernels ${VATTNAB_KERNELS:-mma} --json "$OUT/vattnab/old$r.json" 2>&1 | tail -${VATTNAB_TAIL:-4} ); done
             nb decode --spec none,dflash2:7 --prompt-file suites/data/heldout_prompts.jsonl -n 256 --repeats 1 \
               --json "$OUT/vattnab/held" 2>&1 | tail -10 ;;
    ipc)     mkdir -p "$OUT/ipc"
             timeout ${STAGE_S:-200} python3 scripts/bench_ipc_collectives.py --json "$OUT/ipc/bench.json" 2>&1 \
               | tee "$OUT/ipc/bench.log" | tail -30
             mkdir -p /tmp/pkg; ln -sfn "$PWD" /tmp/pkg/ninfer_bench; export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
             nb decode $M27 --tensor-parallel 2 --spec none,dflash2:7 --replay-acceptance seed -n ${IPC_N:-16} --repeats 1 \
               --json "$OUT/ipc/d27-tp2" 2>&1 | tee "$OUT/ipc/d27-tp2.log" | grep -v Warn | tail -10 ;;
    ksuite)  nb kernels --shape qwen3.8-27b --t 1,8 --repeats 30 --timeline ${KSUITE_OPS:+--ops $KSUITE_OPS} \
               --json "$OUT/kernels_27b.json" 2>&1 | tee "$OUT/kernels_27b.log" | tail -60 ;;
    tilecheck) # does a one-token attention tile give the packed tile's bits on this GPU (scripts/probe_tile_bits.py),
             # then the CUDA tests that compare two DFlash2 runs' acceptance and the verify-row bit tests, with tracebacks
             timeout ${STAGE_S:-300} python3 scripts/probe_tile_bits.py 2>&1 | tee "$OUT/tile_bits.log"
             timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_cuda_engine.py \
               -k "verify_rows or spec_on_cuda or block_draft or pdl_decode_equals_plain_launches and dflash2" \
               2>&1 | tee "$OUT/tilecheck_tests.log" | tail -40 ;;
    main)    # the README's main command on this GPU (the bundled model, DFlash2 K=7 beside plain)
             nb decode --spec dflash2 -k 7 2>&1 | tail -8 ;;
    bundled) # the bundled model's full GPU set for the report: decode grid with the peer (BUNDLED_ENGINES), concurrency,
             # kernels (BUNDLED_KERNELS=0 skips them)
             nb decode --engine ${BUNDLED_ENGINES:-hf,ours} --spec none,mtp:3,dflash2:7 --runtime v3,v2 -n 256 --repeats 2 \
               --json "$OUT/bundled_decode" 2>&1 | tee "$OUT/bundled_decode.log" | tail -20
             nb concurrency -c 1,2,4,8 -n 128 --rounds 2 --json "$OUT/bundled_conc.json" 2>&1 | tail -12
             [ "${BUNDLED_KERNELS:-1}" = 1 ] && nb kernels --model models/ninfer-code-small.ninfer --t 1,8 --repeats 30 \
               --json "$OUT/bundled_kernels.json" 2>&1 | tail -5 ;;
    niah)    nb niah --ctx ${NIAH_GRID:-8192,16384,32768,65536} --cudnn-prefill ${NIAH_CUDNN:-off} \
               --json "$OUT/niah_bundled.json" --heatmap "$OUT/niah_bundled.png" \
               2>&1 | tail -25 ;;
    niahctx) # NIAH at the bundled model's native context (issue 32, item 5): NIAH_CTX (default 131,072, its
             # max_position_embeddings) x NIAH_DEPTHS, int8 K/V; TTFT and prefill tok/s a case (no oracles stored past
             # 65,536: those cases report retrieval only)
             nb niah --ctx ${NIAH_CTX:-131072} --depths ${NIAH_DEPTHS:-0,50,100} --cudnn-prefill ${NIAH_CUDNN:-off} \
               --json "$OUT/niah_ctx.json" 2>&1 | tail -14
             python3 - "$OUT/niah_ctx.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    print(f"{r['case']}: {r['prompt_tokens']} tokens, TTFT {r['ttft_ms']:.0f} ms, prefill {r['prefill_tok_s']:.0f} "
          f"tok/s, retrieved {r['retrieved']}, oracle pass {r.get('pass')}")
PY
             ;;
    conc27)  nb concurrency $M27 -c 1,2,4,8 -n 64 --rounds 2 --json "$OUT/conc27.json" 2>&1 | tee "$OUT/conc27.log" | tail -25 ;;
    conc33)  # issue 33's workload at 27B: C1-C8, 256-token prompts, 128 new tokens, plain and DFlash2 K=7 at replayed
             # acceptance (seed); CONC_ARGS adds flags to both (e.g. --interleave-chunk 128)
             mkdir -p "$OUT/conc33"
             for S in none dflash2; do X=""; [ "$S" = dflash2 ] && X="-k 7 --replay-acceptance seed"
               nb concurrency $M27 -c 1,2,4,8 -n 128 --rounds 2 --spec $S $X ${CONC_ARGS:-} \
                 --json "$OUT/conc33/$S.json" 2>&1 | tee "$OUT/conc33/$S.log" | tail -12; done ;;
    pack)    # issue 33's packed admissions: their tests (CUDA: the fused prefill path, plain and DFlash2), then conc33's
             # workload (27B, C1-C8, 256-token prompts, 128 tokens) with --pack-prefill on: plain, DFlash2 K=7 replayed;
             # at C1 / C8: --pack-prefill off, sampled (temperature 0.7, top-p 0.95, top-k 20), and the tree before
             # (.old, when carried) plain
             timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -rf tests/test_fastpath.py -k packed \
               tests/test_concurrency.py 2>&1 | tee "$OUT/pack_tests.log" | tail -4
             mkdir -p "$OUT/pack"
             C27="$M27 -n 128 --rounds 2"
             for V in "on|-c 1,2,4,8 --pack-prefill on" \
                      "dflash2|-c 1,2,4,8 --pack-prefill on --spec dflash2 -k 7 --replay-acceptance seed" \
                      "off|-c 1,8 --pack-prefill off" \
                      "sampled|-c 1,8 --pack-prefill on --temperature 0.7 --top-p 0.95 --top-k 20"; do
               N=${V%%|*}; echo "--- $N"
               nb concurrency $C27 ${V#*|} --json "$OUT/pack/$N.json" 2>&1 | tee "$OUT/pack/$N.log" | tail -7; done
             if [ -d .old ]; then echo "--- old"; ( cd .old && timeout "${STAGE_S:-300}" python3 scripts/nb.py \
               concurrency $C27 -c 1,8 --json "$OUT/pack/old.json" 2>&1 | tee "$OUT/pack/old.log" | tail -7 ); fi ;;
    conc33s) # issue 33's targets with the defaults: the sampler's CUDA tests and the packed prefill's, conc33's workload
             # (27B, 256-token prompts, 128 tokens) plain C1-C8, DFlash2 K=7 replayed C1-C8, sampled (t 0.7, top-p 0.95,
             # top-k 20) C1 / C8, and the bundled model's C8 with --pack-prefill on (its tokens against each alone)
             timeout ${TESTS_S:-150} python3 -m pytest -p no:cacheprovider -rf tests/test_sampler.py \
               tests/test_fastpath.py -k "packed or cuda" 2>&1 | tee "$OUT/conc33s_tests.log" | tail -4
             mkdir -p "$OUT/conc33s"
             C27="$M27 -n 128 --rounds 2"
             for V in "plain|-c 1,2,4,8" "dflash2|-c 1,2,4,8 --spec dflash2 -k 7 --replay-acceptance seed" \
                      "sampled|-c 1,8 --temperature 0.7 --top-p 0.95 --top-k 20"; do
               N=${V%%|*}; echo "--- $N"
               nb concurrency $C27 ${V#*|} --json "$OUT/conc33s/$N.json" 2>&1 | tee "$OUT/conc33s/$N.log" | tail -7; done
             echo "--- bundled C8 packed"
             nb concurrency -c 8 -n 64 --pack-prefill on --json "$OUT/conc33s/bundled_packed.json" 2>&1 \
               | tee "$OUT/conc33s/bundled_packed.log" | tail -5
             echo "--- 27B decode step, 1 and 8 sequences (the scheduler's synchronous steps)"
             timeout ${STAGE_S:-200} python3 scripts/profile_step.py $M27 --batch 1,8 --sync --steps 32 --top 22 \
               --json "$OUT/conc33s/prof_batch.json" 2>&1 | tee "$OUT/conc33s/prof_batch.log" \
               | grep -E "^(===|[0-9]+ steps|GPU busy)" ;;
    vision)  python3 scripts/bench_vision.py 2>&1 | tee "$OUT/vision.log" | tail -20 ;;
    smoke)   timeout 150 python3 scripts/train_bundled.py --tiny --device cuda --out /tmp/tinytrain --ship /tmp/tinyship \
               2>&1 | tee "$OUT/smoke_train.log" | tail -25
             timeout 150 python3 scripts/nb.py decode $M27 -n 32 --repeats 1 --warmup 1 --spec dflash2 -k 7 --json "$OUT/smoke27.json" \
               2>&1 | tail -25 ;;
    train)   python3 scripts/train_bundled.py --out /tmp/bundled --ship "$OUT" --stage all --seed 0 2>&1 \
               | tee "$OUT/train.log" | tail -40 ;;
    redraft) python3 scripts/retrain_drafters.py --out /tmp/redraft --ship "$OUT" --minutes "${REDRAFT_MIN:-5.5}" \
               ${REDRAFT_ARGS:-} 2>&1 \
               | grep -v "falling back" | tee "$OUT/retrain.log" | grep -v "drafters\] step=[0-9]*[1-9]0 " | tail -30 ;;
    specprobe) # speculative paths (captured / eager drafting, PDL on / off) against plain decoding on the bundled
             # model, SPECPROBE_N generates an engine: every line should show plain's tokens and one acceptance
             for sk in "mtp 3" "dflash2 7"; do read -r sp k <<< "$sk"
               timeout ${STAGE_S:-300} python3 scripts/probe_spec_paths.py --spec $sp -k $k -n 256 \
                 --generates ${SPECPROBE_N:-3} 2>&1 | tee -a "$OUT/specprobe.log" | grep -v Warn | tail -16
             done ;;
    chain)   timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_cuda_engine.py \
               -k "spec or chain or draft or lookahead or verify_rows or pdl" 2>&1 | tee "$OUT/chain_tests.log" | tail -25
             nb decode --spec none,mtp:3,dflash2:7 --lookahead on,off --prompt-file suites/data/heldout_prompts.jsonl \
               -n 256 --repeats 2 --json "$OUT/chainb" 2>&1 | tee "$OUT/chainb.log" | tail -14
             /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -8
             for sync in "" --sync; do
               timeout ${STAGE_S:-150} python3 scripts/profile_step.py --spec none,mtp:3,dflash2:7 --steps 64 --top 12 $sync \
                 --json "$OUT/chain_prof${sync:+_sync}.json" 2>&1 | tee -a "$OUT/chain_prof.log" | grep -E "^(===|[0-9]+ steps|a round|GPU busy)"
             done
             nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed --lookahead on,off -n ${SPEC_N:-128} \
               --repeats 2 --json "$OUT/chain27" 2>&1 | tee "$OUT/chain27.log" | tail -14 ;;
    glue)    # the drafters' fused glue and the round's integer kernels: their CUDA tests, the bundled model's held-out
             # prompts with this tree and (when .old holds a copy of the tree before) with that one in the same call,
             # the rounds' kernel profile, the 27B replay grid and the README's main command
             timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_kernels_fused.py \
               tests/test_kernels_spec_round.py tests/test_kernels_select.py tests/test_kernels_attention.py \
               tests/test_fastpath.py tests/test_cuda_engine.py -k "fused or spec_round or select or sdpa_rows or fastpath \
               or spec or chain or draft or lookahead or verify_rows or pdl" 2>&1 | tee "$OUT/glue_tests.log" | tail -25
             held_pair glueb
             timeout ${STAGE_S:-150} python3 scripts/profile_step.py --spec none,mtp:3,dflash2:7 --steps 64 --top 40 \
               --json "$OUT/glue_prof.json" 2>&1 | tee "$OUT/glue_prof.log" | grep -E "^(===|[0-9]+ steps|a round|GPU busy)"
             nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed -n ${SPEC_N:-128} --repeats 2 \
               --json "$OUT/glue27" 2>&1 | tee "$OUT/glue27.log" | tail -8
             /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -8 ;;
    commit)  # one launch for every GDN layer's rollback (kernels/gdn_triton.gdn_commit) and the drafters' head over
             # --lm-head-draft tokens at 27B: their CUDA tests, the 27B replay grid (full head / 32K head x both
             # rollbacks) with this tree and with the tree before (.old) in the same call, and the 27B rounds' profile
             timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
               tests/test_kernels_gdn_triton.py tests/test_fastpath.py tests/test_drafter_import.py \
               tests/test_cuda_engine.py -k "gdn or rollback or commit or fused_verify or random_weights or spec or draft \
               or chain or verify_rows or pdl" 2>&1 | tee "$OUT/commit_tests.log" | tail -25
             R27="$M27 --replay-acceptance seed -n ${SPEC_N:-128} --repeats 2"
             nb decode $R27 --spec none,mtp:3,dflash2:7 --lm-head-draft 0,32768 --rollback recompute,snapshot \
               --json "$OUT/commit27" 2>&1 | tee "$OUT/commit27.log" | tail -14
             if [ -d .old ]; then ( cd .old && timeout ${STAGE_S:-300} python3 scripts/nb.py decode $R27 \
                 --spec none,mtp:3,dflash2:7 --json "$OUT/commit27_old" 2>&1 | tee "$OUT/commit27_old.log" | tail -8 ); fi
             timeout ${STAGE_S:-200} python3 scripts/profile_step.py $M27 --steps 32 --spec none,mtp:3,dflash2:7 \
               --lm-head-draft ${PROF_HEAD:-32768} --top 30 --json "$OUT/commit_prof.json" 2>&1 \
               | tee "$OUT/commit_prof.log" | grep -E "^(===|[0-9]+ steps|a round|GPU busy|_recur|qmv)" ;;
    commitb) # the same on the bundled model: the rest of the CUDA tests, the held-out prompts with this tree and the
             # tree before (.old), the rounds' profile, a short 27B DFlash2 grid, the README's main command
             timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rf tests/test_cuda_engine.py \
               tests/test_spec.py -k "gdn or rollback or commit or fused_verify or spec or draft or chain or verify_rows \
               or pdl or ring_gather" 2>&1 | tee "$OUT/commitb_tests.log" | tail -12
             held_pair commitb
             timeout ${STAGE_S:-150} python3 scripts/profile_step.py --spec none,mtp:3,dflash2:7 --steps 64 --top 40 \
               --json "$OUT/commitb_prof.json" 2>&1 | tee "$OUT/commitb_prof.log" \
               | grep -E "^(===|[0-9]+ steps|a round|GPU busy|_recur|qmv|void at::native::\(anonymous namespace\)::index)"
             nb decode $M27 --replay-acceptance seed -n ${SPEC_N:-128} --repeats 2 --spec none,dflash2:7 \
               --lm-head-draft 0,32768 --json "$OUT/commitb27" 2>&1 | tee "$OUT/commitb27.log" | tail -7
             /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -8 ;;
    spec)    # SPEC_ONLY27=1: the 27B replay grid alone; SPEC_SKIP27=1: the bundled model's runs alone
             [ "${SPEC_SKIP27:-0}" = 1 ] || nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed \
               -n ${SPEC_N:-128} --repeats 2 ${SPEC_ARGS:-} --json "$OUT/spec27" 2>&1 | tee "$OUT/spec27.log" \
               | tail -${SPEC_LINES:-12}
             [ "${SPEC_ONLY27:-0}" = 1 ] && continue
             /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -30
             nb decode --spec none,mtp:3,dflash2:7 --prompt-file suites/data/heldout_prompts.jsonl -n 256 --repeats 2 \
               ${SPECB_ARGS:-} --json "$OUT/specb" 2>&1 | tee "$OUT/specb.log" | tail -${SPEC_LINES:-10} ;;
    rows)    timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_qmv_cuda.py -k \
               "wide or column or packed_linear_runs or silu_epilogue_matches or rows_do_not or graph_replay" 2>&1 \
               | tee "$OUT/rows_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | head -20
             K=${ROWS_KNOBS:-b1,b2,u2b2}; ONLY="ours-r8,ours-r16,ours-r32,ours-r64,qmv-lanes-${K//,/,qmv-lanes-}"
             for FO in "q4|mlp.gate_up,mlp.down,gdn.qkv,gdn.out" "q5|attn.q_gate,attn.o" "q8|lm_head"; do
               OUT=$OUT timeout ${QBENCH_S:-150} python3 scripts/bench_qlinear.py --no-baselines --ts ${ROWS_TS:-16,64} \
                 --rows 8,16,32,64 --qmv-knobs "$K" --only "$ONLY" --fmts ${FO%%|*} --ops ${FO#*|} 2>&1 \
                 | tee -a "$OUT/rows_bench.log" | grep -v "@graph20" | grep -E "ours|qmv|FAIL|DIFFER|copy bandwidth"; done
             [ "${ROWS_CONC:-1}" = 1 ] || continue
             mkdir -p "$OUT/rows"
             C27="$M27 -n 128 --rounds 2"
             nb concurrency $C27 -c 1,8 --spec dflash2 -k 7 --replay-acceptance seed --json "$OUT/rows/dflash2.json" 2>&1 \
               | tee "$OUT/rows/dflash2.log" | tail -6
             nb concurrency $C27 -c 8 --json "$OUT/rows/plain.json" 2>&1 | tee "$OUT/rows/plain.log" | tail -4
             if [ -d .old ]; then ( cd .old && timeout "${STAGE_S:-300}" python3 scripts/nb.py concurrency $C27 -c 8 \
                 --spec dflash2 -k 7 --replay-acceptance seed --json "$OUT/rows/dflash2_old.json" 2>&1 \
                 | tee "$OUT/rows/dflash2_old.log" | tail -4 ); fi ;;
    rowsconc) timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_qmv_cuda.py \
               tests/test_sampler.py -k "wide or column or packed_linear_runs or silu_epilogue_matches or rows_do_not \
               or cuda" 2>&1 | tee "$OUT/rowsconc_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | head -20
             mkdir -p "$OUT/rowsconc"
             for V in "plain|-c 1,8" "dflash2|-c 1,2,4,8 --spec dflash2 -k 7 --replay-acceptance seed" \
                      "sampled|-c 1,8 --temperature 0.7 --top-p 0.95 --top-k 20"; do
               N=${V%%|*}; echo "--- $N"
               nb concurrency $M27 -n 128 --rounds 2 ${V#*|} --json "$OUT/rowsconc/$N.json" 2>&1 \
                 | tee "$OUT/rowsconc/$N.log" | grep -E "^│|error|Error" | head -6; done ;;
    sampler) timeout ${STAGE_S:-120} python3 scripts/probe_sampler.py --json "$OUT/sampler.json" 2>&1 | tee "$OUT/sampler.log" ;;
    ring)    # issue 33: qmv's weights through a per-warp cp.async ring in shared memory (stages), against the register
             # builds: CUDA tests, the 27B shapes at 64 rows (bits checked against 8-row launches), at 1 / 8 rows with
             # RING_T=1, then with RING_C8=1 the 27B DFlash2 K=7 replayed C8 per RING_WIDE build and plain C8 (E2E_S each:
             # a fresh machine's first DFlash2 run spent 129 s compiling before its first request finished)
             mkdir -p "$OUT/ring"
             [ "${RING_TESTS:-1}" = 0 ] || timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -rf \
               tests/test_kernels_qmv_cuda.py -k "${RING_K:-async_ring or tiles_a_block or wide_launch_rows}" 2>&1 \
               | tee "$OUT/ring/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | head
             K=${RING_KNOBS:-p3u1,s4,s6,s4b2,p2s4b1,p2s4b2,p3s4b1}; Q8="q8|lm_head"; [ "${RING_Q8:-1}" = 0 ] && Q8=
             [ "${RING_BENCH:-1}" = 0 ] || ring_bench ring bench64.log "$Q8" --ts 64 --rows 64 --qmv-knobs "$K" \
               --only "ours-r8,ours-r64,qmv-lanes-${K//,/,qmv-lanes-}"
             K1=${RING_KNOBS1:-s4,s6,s4b4,s8b4}
             [ "${RING_T:-0}" = 0 ] || ring_bench ring bench1.log "q8|lm_head" --ts 1,8 --qmv-knobs "$K1" \
               --only "ours,qmv-lanes-${K1//,/,qmv-lanes-}"
             [ "${RING_C8:-0}" = 1 ] && c8_builds ring ${RING_WIDE:-"before|8q4:p3u1b1,8q5:p1" "default|"} ;;
    s64)     # session 64 in one call (see the list above)
             if [ "${S64_TESTS:-all}" = all ]; then bg_test test_kernels_qmv_cuda "fp32"
               bg_test test_kernels_fused "embed or rms_norm"; fi
             bg_test test_kernels_select "link"
             bg_test test_cuda_engine "lookahead_decode"
             wait; bg_report $([ "${S64_TESTS:-all}" = all ] && echo test_kernels_qmv_cuda test_kernels_fused) \
               test_kernels_select test_cuda_engine
             [ -d .old ] && ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
             for r in $(seq ${S64_REPEATS:-1}); do for tree in .old . ${S64_CAP:+cap}; do
               tag=new; [ "$tree" = . ] || tag=old; [ "$tree" = cap ] && { tag=cap$S64_CAP; tree=.; }
               [ -d "$tree" ] || continue
               ( cd "$tree" && NINFER_BENCH_QMV_SPLIT_CAP=$([ "${tag#cap}" != "$tag" ] && echo "$S64_CAP") \
                   timeout 150 python3 scripts/profile_step.py --spec ${PROF_SPECS:-none,dflash2:7} --steps 64 \
                   --top 30 --json "$OUT/bprof-$tag-$r.json" > "$OUT/bprof-$tag-$r.log" 2>&1 )
               echo "--- bundled step profile, $tag tree, run $r: rc $?"; grep -E "^=== |a step" "$OUT/bprof-$tag-$r.log" | head -8
             done; done
             for tree in . .old; do [ -d "$tree" ] || continue; tag=new; [ "$tree" = . ] || tag=old
               ( cd "$tree" && timeout ${STAGE_S:-200} python3 scripts/nb.py decode --spec ${S64_SPECS:-none,dflash2:7} $HELD \
                   --json "$OUT/held-$tag" > "$OUT/held-$tag.log" 2>&1 )
               echo "--- bundled held-out, $tag tree: rc $?"; grep -E "│ v3-|decode tok/s|tokens sha256" "$OUT/held-$tag.log"
             done
             [ -n "${S64_CAP:-}" ] && { NINFER_BENCH_QMV_SPLIT_CAP=$S64_CAP nb decode --spec none $HELD \
                 --json "$OUT/held-cap$S64_CAP" > "$OUT/held-cap$S64_CAP.log" 2>&1
               echo "--- bundled held-out, new tree, qmv splits capped at $S64_CAP: rc $?"
               grep -E "decode tok/s|tokens sha256" "$OUT/held-cap$S64_CAP.log"; }
             nb decode --spec dflash2 -k 7 --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -6 ;;
    s64b)    # session 64's second part (see the list above)
             bg_test test_kernels_qmv_cuda "cluster"
             bg_test test_cuda_engine "lookahead_decode"
             wait; bg_report test_kernels_qmv_cuda test_cuda_engine
             for r in $(seq ${S64B_REPEATS:-2}); do for v in ${S64B_VARIANTS:-new ws}; do
               env $(qmv_env $v) timeout 150 python3 scripts/profile_step.py --spec none --steps 64 --top 30 \
                 --json "$OUT/bprof-$v-$r.json" > "$OUT/bprof-$v-$r.log" 2>&1
               echo "--- bundled step, $v, run $r: rc $? $(grep -E 'without the profiler' "$OUT/bprof-$v-$r.log")"; done; done
             held_variants ${S64_SPECS:-none,dflash2:7} ${S64B_VARIANTS:-new ws}
             nb decode --spec dflash2 -k 7 --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -6 ;;
    s65)     # session 65 (see the list above)
             bg_test test_kernels_qmv_cuda "${S65_K:-pieces or cluster or fp32 or silu}"
             [ "${S65_ENGINE_TESTS:-1}" = 0 ] || { bg_test test_kernels_select "link"
               bg_test test_cuda_engine "lookahead_decode"; }
             wait; bg_report test_kernels_qmv_cuda $([ "${S65_ENGINE_TESTS:-1}" = 0 ] || echo test_kernels_select test_cuda_engine)
             timeout 150 python3 scripts/probe_qmv_pieces.py --bundled --json "$OUT/pieces-bundled.json" 2>&1 \
               | tee "$OUT/pieces-bundled.log"
             [ "${PIECES_GRID:-1}" = 0 ] || timeout ${GRID_S:-200} python3 scripts/probe_qmv_pieces.py \
               ${PIECES_GRID_ARGS:-} --json "$OUT/pieces-grid.json" > "$OUT/pieces-grid.log" 2>&1; echo "--- grid rc $?"; cat "$OUT/pieces-grid.log"
             for r in $(seq ${S65_REPEATS:-2}); do for v in ${S65_VARIANTS:-new nopieces cap1}; do
               env $(qmv_env $v) timeout 150 python3 scripts/profile_step.py --spec none --steps 64 --top 30 \
                 --json "$OUT/bprof-$v-$r.json" > "$OUT/bprof-$v-$r.log" 2>&1
               echo "--- bundled step, $v, run $r: rc $? $(grep -E 'without the profiler' "$OUT/bprof-$v-$r.log")"; done; done ;;
    s65b)    # session 65's end-to-end runs (see the list above)
             held_variants none,dflash2:7 ${S65B_VARIANTS:-new nopieces}
             nb decode --spec dflash2 -k 7 --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -6
             [ "${S65_27B:-0}" = 1 ] && for v in ${S65B_VARIANTS:-new nopieces}; do
               env $(qmv_env $v) timeout ${STAGE_S:-200} python3 scripts/nb.py decode $M27 -n 64 --repeats 2 \
                 --json "$OUT/d27-$v.json" > "$OUT/d27-$v.log" 2>&1
               echo "--- 27B, $v: rc $?"; grep -E "decode tok/s|tokens sha256|roofline" "$OUT/d27-$v.log" | head -4; done ;;
    s65c)    # session 65's third part (see the list above)
             bg_test test_kernels_qmv_cuda "${S65C_K:-pdl_launch_equals or pieces_walked or split_k_is or rows_do_not or pdl_dependent_chain}"
             wait; bg_report test_kernels_qmv_cuda
             [ -d .old ] && ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
             for r in $(seq ${S65C_REPEATS:-2}); do for tree in .old .; do [ -d "$tree" ] || continue
               tag=new; [ "$tree" = . ] || tag=old
               ( cd "$tree" && timeout 150 python3 scripts/profile_step.py --spec none --steps 64 --top 30 \
                   --json "$OUT/bprof-$tag-$r.json" > "$OUT/bprof-$tag-$r.log" 2>&1 )
               echo "--- bundled step, $tag tree, run $r: rc $? $(grep -E 'without the profiler' "$OUT/bprof-$tag-$r.log")"
             done; done
             for tree in . .old; do [ -d "$tree" ] || continue; tag=new; [ "$tree" = . ] || tag=old
               ( cd "$tree" && timeout ${STAGE_S:-200} python3 scripts/nb.py decode --spec none,dflash2:7 $HELD \
                   --json "$OUT/held-$tag" > "$OUT/held-$tag.log" 2>&1 )
               echo "--- bundled held-out, $tag tree: rc $?"; grep -E "│ v3-|tokens sha256" "$OUT/held-$tag.log"; done
             nb decode --spec dflash2 -k 7 --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -6 ;;
    tpw)     # wide qmv launches with several row tiles a block (x loaded once for them): their CUDA tests, the 27B q4 /
             # q5 shapes at 64 rows (TPW_KNOBS against the default and 8-row launches, bits checked; TPW_BENCH=0 skips
             # it), then the 27B DFlash2 K=7 replayed C8 with each TPW_WIDE build (label|NINFER_BENCH_QMV_WIDE; default:
             # one tile a block at 8 column groups, then the build as committed), plain C8 last
             mkdir -p "$OUT/tpw"
             timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider -rf tests/test_kernels_qmv_cuda.py \
               -k "tiles_a_block or wide_builds or wide_launch" 2>&1 | tee "$OUT/tpw/tests.log" \
               | grep -E "^(FAILED|ERROR)|passed|failed" | head
             K=${TPW_KNOBS:-p2u1,p3u1}; ONLY="ours-r8,ours-r64,qmv-lanes-${K//,/,qmv-lanes-}"
             [ "${TPW_BENCH:-1}" = 0 ] || for FO in "q4|mlp.gate_up,mlp.down,gdn.qkv,gdn.out" "q5|attn.q_gate,attn.o"; do
               OUT=$OUT/tpw timeout ${QBENCH_S:-100} python3 scripts/bench_qlinear.py --no-baselines --ts 64 --rows 64 \
                 --qmv-knobs "$K" --only "$ONLY" --fmts ${FO%%|*} --ops ${FO#*|} 2>&1 | tee -a "$OUT/tpw/bench.log" \
                 | grep -v "@graph20" | grep -E "ours|qmv|FAIL|DIFFER|copy bandwidth"; done
             E2E_S=${E2E_S:-200} c8_builds tpw ${TPW_WIDE:-"onetile|8:p1" "default|"} ;;
    ncuqmv)  # Nsight Compute on wide qmv launches (issue 33): each NCU_QMV case op:fmt:rows, every launch of every
             # NCU_QMV_KNOBS build (scripts/probe_qmv_wide.py; empty = the default build), full sections, clocks left
             # alone; one report a case, kept on the machine (session 52's reports were too big to come back): $OUT
             # gets each case's log, its raw page gzipped and the table scripts/ncu_table.py prints from it
             if ! command -v ncu >/dev/null; then echo "ncu: not on the PATH"; else
               mkdir -p "$OUT/ncuqmv" /tmp/ncuqmv
               for c in $(echo ${NCU_QMV:-mlp.down:q4:64,mlp.gate_up:q4:64,mlp.down:q4:8} | tr , ' '); do
                 IFS=: read -r op fmt rows <<< "$c"; name="${op}_${fmt}_${rows}"; rep="/tmp/ncuqmv/$name"
                 timeout ${STAGE_S:-240} ncu --clock-control none --kernel-name qmv --launch-count 1000 --set full \
                   -o "$rep" -f python3 scripts/probe_qmv_wide.py --op $op --fmt $fmt --rows $rows \
                   --knobs "${NCU_QMV_KNOBS:-p1,p3u1}" --launches 1 > "$OUT/ncuqmv/$name.log" 2>&1
                 echo "--- $c: ncu rc $?"; grep -E "build=|^==PROF==.*(rror|arning)|Error" "$OUT/ncuqmv/$name.log" | head -6
                 ncu --import "$rep.ncu-rep" --page raw --csv 2>/dev/null > "$rep.csv"
                 python3 scripts/ncu_table.py < "$rep.csv" | tee "$OUT/ncuqmv/$name.table"; gzip -c "$rep.csv" > "$OUT/ncuqmv/$name.csv.gz"
               done
             fi ;;
    tp1gpu)  # tensor parallelism's CUDA path on one GPU: two ranks over gloo sharing it (collectives staged through
             # host memory: a check of the split, not a speed) against one rank - the 27B synthetic decode (TP_RUNTIME,
             # default v3: the fused kernels without graphs under TP; plain and MTP3) and the tiny preset's in-process
             # concurrency (rank 0's scheduler mirrored); TP_MODEL replaces the 27B (e.g. "--model tiny")
             mkdir -p "$OUT/tp1gpu"
             for TP in 1 2; do
               nb decode ${TP_MODEL:-$M27} --runtime ${TP_RUNTIME:-v3} --spec none,mtp:3 -n ${TP_N:-24} --repeats 1 --tensor-parallel $TP \
                 --json "$OUT/tp1gpu/d27-tp$TP" 2>&1 | tee "$OUT/tp1gpu/d27-tp$TP.log" | grep -v Warn | tail -8
               nb concurrency --model tiny --runtime ${TP_RUNTIME:-v3} -c 1,2 -n 16 --rounds 1 --tensor-parallel $TP \
                 --json "$OUT/tp1gpu/conc-tp$TP.json" 2>&1 | tee "$OUT/tp1gpu/conc-tp$TP.log" | grep -E "^│|rror" | head -4
             done
             python3 - "$OUT/tp1gpu" <<'PY'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
for tp in (1, 2):
    for p in sorted((root / f"d27-tp{tp}").glob("*.json")):
        s = json.loads(p.read_text())["summary"]
        print(f"d27 tp{tp} {p.stem}: tokens {s['tokens_sha256'][:12]} {s['decode_tok_s']:.1f} tok/s")
    d = json.loads((root / f"conc-tp{tp}.json").read_text())
    print(f"conc tp{tp}: " + " ".join(r["tokens_sha256"][:8] for r in d["records"]))
PY
             ;;
    prof8)   # where a C8 speculative round goes at the 27B shape: profile_step --batch 8 --sync, plain and DFlash2 K=7
             # (synthetic weights: the rounds' cost, not their acceptance)
             timeout ${STAGE_S:-240} python3 scripts/profile_step.py $M27 --spec none,dflash2:7 --batch 1,8 --sync \
               --steps ${PROF8_STEPS:-16} --top 25 --json "$OUT/prof8.json" 2>&1 | tee "$OUT/prof8.log" | grep -v Warn ;;
    pgemm)   # a prompt chunk's projection GEMMs alone at each row count (scripts/bench_prefill_gemm.py; PGEMM_ARGS adds
             # flags, e.g. "--m 2048,3072,8192 --variants linear,swap")
             mkdir -p "$OUT/pgemm"
             timeout ${STAGE_S:-120} python3 scripts/bench_prefill_gemm.py --model qwen3.8-27b ${PGEMM_ARGS:-} \
               --json "$OUT/pgemm/gemm.json" 2>&1 | tee "$OUT/pgemm/gemm.log" | cut -c1-250 | tail -24 ;;
    pytestk) # chosen CUDA tests in one process: PYTEST_K ("-k" expression) over PYTEST_FILES
             timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider --durations=5 ${PYTEST_FILES:-tests} \
               -k "${PYTEST_K:-cuda}" > "$OUT/pytestk.log" 2>&1; echo "pytest rc $?"
             grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytestk.log" | tail -12 ;;
    dattn)   # a block drafter's attention read in place (kernels/draft_attention.py, issue 31): its CUDA tests and the
             # drafting / engine tests around it, the 27B C1 rounds' profile with it on / off at replayed acceptance,
             # the 27B replay grid with it on / off
             timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider --durations=5 \
               tests/test_kernels_draft_attention.py tests/test_fastpath.py tests/test_cuda_engine.py \
               -k "${PYTEST_K:-draft or in_place or dflash or pdl}" > "$OUT/dattn_tests.log" 2>&1; echo "pytest rc $?"
             grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dattn_tests.log" | tail -12
             timeout ${STAGE_S:-300} python3 scripts/profile_step.py $M27 --spec none,dflash2:7 --lm-head-draft 32768 \
               --steps ${PROFSPEC_STEPS:-32} --top ${PROFILE_LINES:-30} --draft-attention on,off \
               --replay-acceptance seed --json "$OUT/dattn_prof.json" 2>&1 | tee "$OUT/dattn_prof.log" | grep -v Warn
             nb decode $M27 --spec none,dflash2:7 --replay-acceptance seed --lm-head-draft 32768 -n 128 --repeats 2 \
               --draft-attention on,off ${SPEC_ARGS:-} --json "$OUT/dattn27" 2>&1 | tee "$OUT/dattn27.log" \
               | tail -${SPEC_LINES:-10} ;;
    dattn2)  # the draft attention's ranges (scripts/bench_draft_attention.py beside the torch path it replaced), its
             # CUDA tests, token invariance with short key ranges split in chunks of ATTN_MS steps at least
             # (NINFER_BENCH_ATTN_MIN_STEPS), and the 27B plain step / DFlash2 round profile at replayed acceptance for
             # each MIN_STEPS_LIST value (kernels/attn_cuda.SHORT_MIN_STEPS)
             timeout 120 python3 scripts/bench_draft_attention.py --json "$OUT/bench_dattn.json" 2>&1 | tail -20
             timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_draft_attention.py \
               > "$OUT/dattn2_tests.log" 2>&1; echo "pytest rc $?"
             NINFER_BENCH_ATTN_MIN_STEPS=${ATTN_MS:-4} timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider \
               tests/test_kernels_attn_cuda.py tests/test_cuda_engine.py -k "bits or rows_a_verify or verify_rows or chained" \
               >> "$OUT/dattn2_tests.log" 2>&1; echo "pytest (min steps ${ATTN_MS:-4}) rc $?"
             grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dattn2_tests.log" | tail -12
             timeout ${STAGE_S:-300} python3 scripts/profile_step.py $M27 --spec none,dflash2:7 --lm-head-draft 32768 \
               --steps ${PROFSPEC_STEPS:-64} --top ${PROFILE_LINES:-14} --attn-min-steps ${MIN_STEPS_LIST:-1,4,8} \
               --replay-acceptance seed --json "$OUT/dattn2_prof.json" 2>&1 | tee "$OUT/dattn2_prof.log" \
               | grep -v Warn | grep -E "^===|steps|round|busy|qmv|attn|_recur|draft" ;;
    dattn3)  # issue 31's grid with the draft attention on / off: the 27B replay grid (32K draft head), the bench of the
             # draft attention, the README's main command, the bundled model's held-out prompts
             nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed --lm-head-draft 32768 -n 128 \
               --repeats 2 --draft-attention on,off --json "$OUT/spec27" 2>&1 | tee "$OUT/spec27.log" | tail -12
             timeout 120 python3 scripts/bench_draft_attention.py --splits 4,8,16 --json "$OUT/bench_dattn.json" 2>&1 \
               | tail -8
             /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -12
             nb decode --spec none,mtp:3,dflash2:7 --prompt-file suites/data/heldout_prompts.jsonl -n 256 --repeats 2 \
               --draft-attention on,off --json "$OUT/specb" 2>&1 | tee "$OUT/specb.log" | tail -10 ;;
    dattn4)  # the 27B replay grid after the chained rounds stopped queuing past the length limit, then the chained
             # rounds' CUDA tests
             nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed --lm-head-draft 32768 -n 128 \
               --repeats 2 --json "$OUT/spec27" 2>&1 | tee "$OUT/spec27.log" | tail -9
             timeout ${TESTS_S:-60} python3 -m pytest -q -p no:cacheprovider tests/test_cuda_engine.py -k chained \
               > "$OUT/chained_tests.log" 2>&1; echo "pytest rc $?"; tail -3 "$OUT/chained_tests.log" ;;
    ring31)  # issue 31 after DFlash2's window ring stopped writing two prompt positions to one entry (CUDA kept either):
             # the bundled model's held-out grid, the README's main command, the 27B replay grid (32K draft head,
             # after the chained rounds' length rule) and the chained rounds' CUDA tests
             held_main
             nb decode $M27 --spec none,mtp:3,dflash2:7 --replay-acceptance seed --lm-head-draft 32768 -n 128 \
               --repeats 2 --json "$OUT/spec27" 2>&1 | tee "$OUT/spec27.log" | tail -9
             chained_tests ;;
    grid31)  # issue 31 on the installed artifact: the bundled held-out grid, the README's main command, the chained
             # rounds' CUDA tests
             held_main; chained_tests ;;
    selfdraft) # issue 31: the DFlash2 drafter trained on the target's own greedy continuations mixed with corpus rows
             # (retrain_drafters.py --data mix), before / after on the 64 held-out prompts x 256 tokens, the new
             # artifact in parts (back here: retrain_drafters.py join $OUT)
             python3 scripts/retrain_drafters.py --out /tmp/redraft --ship "$OUT" --data mix --kinds dflash2 \
               --labels path --blocks 4,8,12,8,16,8 --gen-sequences "${SELF_SEQS:-16384}" --gen-batch "${SELF_BATCH:-64}" \
               --gen-minutes "${SELF_GEN_MIN:-1.5}" --minutes "${REDRAFT_MIN:-4}" --eval-prompts 64 --eval-new 256 \
               --minutes-eval 1.5 ${REDRAFT_ARGS:-} 2>&1 | grep -v "falling back" | tee "$OUT/retrain.log" \
               | grep -v "drafters\] step=[0-9]*[1-9]0 " | grep -v "\[selfgen\]" | tail -40
             if [ "${SELF_GRID:-0}" = 1 ]; then held_main _new /tmp/redraft/export/ninfer-code-small.ninfer; fi ;;
    profspec) # where a C1 speculative round goes at the 27B shape (issue 31): plain, MTP3 and DFlash2 K=7 chained,
             # one process, the draft head over 32,768 tokens (synthetic weights: no drafts accepted)
             timeout ${STAGE_S:-300} python3 scripts/profile_step.py $M27 --spec none,mtp:3,dflash2:7 \
               --lm-head-draft 32768 --steps ${PROFSPEC_STEPS:-64} --top ${PROFILE_LINES:-40} ${PROFSPEC_ARGS:-} \
               --json "$OUT/profspec.json" 2>&1 | tee "$OUT/profspec.log" | grep -v Warn ;;
    sampled) # the step sampler (issue 33): its CUDA tests, probe_sampler.py with this tree (and the tree before in .old,
             # carried, when there), then the 27B plain / sampled concurrency at C1 and C8 (and .old's sampled C8)
             mkdir -p "$OUT/sampled"
             timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/test_sampler.py -k cuda 2>&1 \
               | tee "$OUT/sampled/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | head -20
             timeout ${STAGE_S:-120} python3 scripts/probe_sampler.py --json "$OUT/sampled/probe.json" 2>&1 \
               | tee "$OUT/sampled/probe.log"
             if [ -d .old ]; then ( cd .old && timeout ${STAGE_S:-120} python3 scripts/probe_sampler.py 2>&1 ) \
               | tee "$OUT/sampled/probe_old.log"; fi
             for V in "plain|-c 1,8" "sampled|-c 1,8 --temperature 0.7 --top-p 0.95 --top-k 20"; do
               N=${V%%|*}; echo "--- $N"
               nb concurrency $M27 -n 128 --rounds 2 ${V#*|} --json "$OUT/sampled/$N.json" 2>&1 \
                 | tee "$OUT/sampled/$N.log" | grep -E "^│|error|Error" | head -6; done
             if [ -d .old ]; then echo "--- sampled, .old"; ( cd .old && timeout "${STAGE_S:-300}" python3 scripts/nb.py \
               concurrency $M27 -n 128 --rounds 2 -c 8 --temperature 0.7 --top-p 0.95 --top-k 20 \
               --json "$OUT/sampled/sampled_old.json" 2>&1 ) | tee "$OUT/sampled/sampled_old.log" | grep -E "^│|error|Error" \
               | head -6; fi ;;
    hashes)  /usr/bin/time -f "main command: %e s wall, %M KiB peak RSS" python3 scripts/nb.py decode --spec dflash2 -k 7 \
               --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -6
             nb decode --spec none,mtp:3 --repeats 1 --json "$OUT/hb" 2>&1 | tail -8
             nb decode $M27 --spec none,mtp:3,dflash2:7 -n 64 --repeats 1 --json "$OUT/h27" 2>&1 | tail -8
             python3 - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("**/*.json")):
    d = json.loads(p.read_text()); s = d["summary"]
    print(f"{p.parent.name}/{p.name}: {d['label']} {s['tokens_sha256'][:8]} {s['decode_tok_s']:.1f} tok/s "
          f"{s.get('tokens_per_round') or 1:.2f} tok/round")
PY
             ;;
    convert27) # issue 39: a 27B-shaped FP8 checkpoint written by transformers, converted (streamed, on the GPU),
             # verified, inspected and decoded beside the synthetic 27B; wall time and peak RSS of each step
             C=${CONVERT_DIR:-/tmp/ck27}; A=${CONVERT_OUT:-/tmp/q27.ninfer}; rm -rf "$C" "$A"; mkdir -p "$OUT/conv27"
             T() { /usr/bin/time -f "$1: %e s wall, %M KiB peak RSS" "${@:2}"; }
             T make_checkpoint python3 scripts/make_checkpoint.py "$C" --shape 27b --dtype fp8 --device cuda 2>&1 \
               | grep -v "Writing model shards" | tail -4
             df -h "$(dirname "$A")" | tail -1
             T convert timeout "${STAGE_S:-400}" python3 scripts/nb.py convert "$C" "$A" --quant mixed 2>&1 | tail -4
             T verify python3 scripts/nb.py verify "$A" 2>&1 | tail -2
             T inspect python3 scripts/nb.py inspect "$A" --json 2>&1 > "$OUT/conv27/inspect.json"
             python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('inspect checks', d['checks'])" \
               "$OUT/conv27/inspect.json"
             rm -rf "$C"
             T decode_file python3 scripts/nb.py decode --model "$A" -n 64 --repeats 3 --json "$OUT/conv27/file.json" \
               2>&1 | tail -4
             T decode_synthetic python3 scripts/nb.py decode $M27 -n 64 --repeats 3 --json "$OUT/conv27/synthetic.json" \
               2>&1 | tail -4
             python3 - "$OUT/conv27" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    if p.name == "inspect.json":
        continue
    s = json.loads(p.read_text())["summary"]
    print(f"{p.name}: {s['decode_tok_s']:.1f} tok/s {s['samples']['decode_tok_s']} {s['tokens_sha256'][:8]}")
PY
             ;;
    llamabuild) export LLBUILD_ARGS=${LLBUILD_ARGS:-}; rm -rf /tmp/llsrc /tmp/llsite /tmp/llbuild.rc; mkdir -p /tmp/llsrc && tar xzf .peer/llama-src.tgz -C /tmp/llsrc
             nvcc --version | tail -2
             setsid bash -c 'cd /tmp/llsrc/llama_cpp_python-* && s=$(date +%s) && CMAKE_BUILD_PARALLEL_LEVEL=16 \
               CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DGGML_NATIVE=ON $LLBUILD_ARGS" \
               python3 -m pip install -v --no-build-isolation --no-deps --no-index --target /tmp/llsite . \
               > /tmp/llbuild.log 2>&1; echo "$? $(( $(date +%s) - s ))" > /tmp/llbuild.rc' < /dev/null > /dev/null 2>&1 &
             if [ "${LLBUILD_WAIT:-0}" = 1 ]; then llwait; fi ;;
    export27|peer27)  # the 27B export is written while llamabuild's background build runs (both need minutes)
             if [ -s /tmp/q27.gguf ]; then echo "export-gguf 27B: /tmp/q27.gguf kept from an earlier call"; else
               /usr/bin/time -f "export-gguf 27B: %e s wall, %M KiB peak RSS" python3 scripts/nb.py export-gguf \
                 qwen3.8-27b /tmp/q27.gguf --synthetic --device cuda 2>&1 | tail -3  # written atomically
             fi
             [ "$stage" = export27 ] && continue
             llwait || continue
             export PYTHONPATH=/tmp/llsite:${PYTHONPATH:-}
             if [ "${PEER8K:-1}" = 1 ]; then
               /usr/bin/time -f "peer27 8K: %e s wall, %M KiB peak RSS" timeout ${STAGE_S:-500} python3 scripts/nb.py decode \
                 $M27 --engine ours,llamacpp --llamacpp-gguf /tmp/q27.gguf -n ${PEER_N:-128} --repeats ${PEER_REPEATS:-2} \
                 --json "$OUT/peer27" 2>&1 | tee "$OUT/peer27.log" | tail -32
             fi
             if [ "${PEER65K:-0}" = 1 ]; then
               python3 -c "t=open('suites/data/haystack.py.txt', encoding='utf-8').read().encode('ascii', 'ignore');
t=(t*(65000//len(t)+1))[:65000]; open('/tmp/p65k.txt','wb').write(t)"
               /usr/bin/time -f "peer27 65K: %e s wall, %M KiB peak RSS" timeout ${STAGE_S:-500} python3 scripts/nb.py decode \
                 $M27 --engine ours,llamacpp --llamacpp-gguf /tmp/q27.gguf --prompt-file /tmp/p65k.txt --max-context 65600 \
                 -n 16 --repeats 1 --json "$OUT/peer27_65k" 2>&1 | tee "$OUT/peer27_65k.log" | tail -30
             fi ;;
    pgraphs) # prefill CUDA graphs: their tests beside the engine's, then the 27B synthetic with them on / off
             python3 -m pytest -q -x tests/test_prefill_graphs.py tests/test_sampler.py 2>&1 | tail -4
             timeout ${STAGE_S:-300} python3 -m pytest -q -x tests/test_cuda_engine.py 2>&1 | tail -4
             nb decode $M27 --prefill-graphs on,off -n 32 --repeats 3 --json "$OUT/pgraphs27" 2>&1 | tail -6
             python3 - "$OUT/pgraphs27" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    s = json.loads(p.read_text())["summary"]
    print(f"{p.name}: prefill {s['prefill_tok_s']:.0f} tok/s {[round(x) for x in s['samples']['prefill_tok_s']]}, "
          f"TTFT {s['ttft_ms']:.1f} ms {[round(x, 1) for x in s['samples']['ttft_ms']]}, decode {s['decode_tok_s']:.1f} "
          f"tok/s, {s.get('prompt_tokens')} prompt tokens, {s['tokens_sha256'][:8]}")
PY
             ;;
    plen27)  # issue 32's prompt-length grid: the 27B synthetic beside the transformers peer on exact-length prompts
             nb decode $M27 --engine ${PLEN_ENGINES:-ours,hf} -p ${PLEN:-2991,65000} -n ${PLEN_N:-128} --repeats 2 \
               ${PLEN_ARGS:-} --json "$OUT/plen27" 2>&1 | tail -12 ;;
    ptma)    # the prefill attention through tensor descriptors (session 57): its CUDA tests, the kernel at the 27B shape
             # after PTMA_STARTS keys (bench_prefill_attention --sweep tma: with and without descriptors), the 27B
             # prompt-length grid (PLEN) ours beside the peer (PTMA_ENGINES) with the default plan, then ours with
             # pointer loads (NINFER_BENCH_PREFILL_PLAN=tma=0, recorded in the result's knobs)
             TESTS_S=${TESTS_S:-90} run_tests test_kernels_attention_prefill
             timeout ${PTMA_BENCH_S:-120} python3 scripts/bench_prefill_attention.py --sweep tma \
               --starts ${PTMA_STARTS:-63488} --json "$OUT/ptma.jsonl" > "$OUT/ptma.log" 2>&1
             grep "^start" "$OUT/ptma.log" | grep -v "sdpa-copy\|dequant " | cut -c1-130
             nb decode $M27 --engine ${PTMA_ENGINES:-ours,hf} -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 \
               --json "$OUT/ptma-default" 2>&1 | tail -8
             NINFER_BENCH_PREFILL_PLAN=tma=0 nb decode $M27 -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 \
               --json "$OUT/ptma-pointer" 2>&1 | tail -6 ;;
    ppast)   # the bulk of a long prompt's chunk (its past keys, no mask): ours beside torch SDPA's cuDNN and flash
             # backends (bench_prefill_attention --past) after PPAST_STARTS keys
             timeout ${PPAST_S:-150} python3 scripts/bench_prefill_attention.py --past --starts ${PPAST_STARTS:-8192,63488} \
               --json "$OUT/ppast.jsonl" > "$OUT/ppast.log" 2>&1; echo "bench rc $?"
             grep "^start" "$OUT/ppast.log" | grep -v "sdpa-copy\|dequant \| copy " | cut -c1-170 ;;
    cudnnp)  # a long prompt chunk's past keys through cuDNN (--cudnn-prefill, session 58-59): its tests, the kernel
             # bench (flash-copy against cudnn-split, and --past) after CUDNNP_STARTS keys, the 27B prompt grid (PLEN)
             # with --cudnn-prefill on,off in one process (CUDNNP_ENGINES: add hf for the peer)
             TESTS_S=${TESTS_S:-120} run_tests test_kernels_attention_prefill test_fastpath
             timeout ${PPAST_S:-150} python3 scripts/bench_prefill_attention.py --past \
               --starts ${CUDNNP_STARTS:-2048,8192,32768,63488} --json "$OUT/cudnnp.jsonl" > "$OUT/cudnnp.log" 2>&1
             echo "bench rc $?"; grep "^start" "$OUT/cudnnp.log" | grep -v "sdpa-copy\|dequant \| copy \|flash-int8\|-rep " | cut -c1-150
             nb decode $M27 --engine ${CUDNNP_ENGINES:-ours} -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 \
               --cudnn-prefill on,off --json "$OUT/cudnnp-grid" 2>&1 | tee "$OUT/cudnnp-grid.log" | tail -10 ;;
    verify62) # session 62's pieces that had not run on a GPU after its review: the captured-prefill tests (the fused glue's
             # padded path, plain decoding through the chain link), conv_state_update's window kernel, the GDN decode
             # kernels' and the chained decode's CUDA tests; then the bundled decode step's profile
             bg_test test_prefill_graphs "captured or final or padded"
             bg_test test_cuda_engine "lookahead_decode or chain"
             TESTS_S=${TESTS_S:-200} run_tests test_kernels_gdn_prefill test_kernels_gdn_triton; wait
             bg_report test_prefill_graphs test_cuda_engine
             timeout 90 python3 scripts/profile_step.py --steps 64 --top 30 --json "$OUT/bprof.json" > "$OUT/bprof.log" 2>&1
             echo "--- bundled step: rc $?"; grep -E "a step|GPU busy" "$OUT/bprof.log" | head -2 ;;
    s62)     # session 62's call (see the header): each part's output under $OUT, the tests' logs in tests_all.log
             TESTS_S=${TESTS_S:-150} bg_test test_prefill_graphs "captured or final or padded"
             TESTS_S=${TESTS_S:-150} bg_test test_cuda_engine "lookahead_decode"
             TESTS_S=${TESTS_S:-150} run_tests test_kernels_gdn_prefill test_kernels_select; wait
             bg_report test_prefill_graphs test_cuda_engine
             B=""; [ -f .old/kernels/gdn_prefill.py ] && B="--baseline .old/kernels/gdn_prefill.py"
             timeout 120 python3 scripts/bench_gdn_prefill.py --block-t ${GLUE_BT:-16:4,16:2,32:4} $B 2>&1 \
               | tee "$OUT/gdnglue-bench.log" | tail -12
             if [ -f .old/scripts/nb.py ]; then ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
               ( cd .old && timeout 200 python3 scripts/nb.py decode $M27 -p ${PLEN:-2991,65000} -n 32 --repeats 2 \
                   --json "$OUT/grid-old" 2>&1 | tee "$OUT/grid-old.log" | tail -5 )
               ( cd .old && timeout 120 python3 scripts/nb.py decode --spec none $HELD --json "$OUT/held-old" 2>&1 \
                   | tee "$OUT/held-old.log" | tail -4 ); fi
             timeout ${S62_GRID_S:-200} python3 scripts/nb.py decode $M27 --engine ${S62_ENGINES:-ours} -p ${PLEN:-2991,65000} \
               -n 32 --repeats 2 --json "$OUT/grid-new" 2>&1 | tee "$OUT/grid-new.log" | tail -5
             timeout 120 python3 scripts/nb.py decode --spec none $HELD --json "$OUT/held-new" 2>&1 | tee "$OUT/held-new.log" \
               | tail -4
             for bv in default ${S62_GDN_BV:-128}; do a=""; [ $bv != default ] && a="--gdn-block-v $bv"
               timeout 90 python3 scripts/profile_step.py --steps 64 --top 30 $a --json "$OUT/bprof-$bv.json" \
                 > "$OUT/bprof-$bv.log" 2>&1; echo "--- bundled step, GDN block_v $bv: rc $?"
               grep -E "a step|GPU busy" "$OUT/bprof-$bv.log" | head -2; done
             timeout 120 python3 scripts/nb.py decode --spec dflash2 -k 7 --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" \
               | tail -5
             [ "${S62_PROBE:-1}" = 1 ] && timeout 90 python3 scripts/probe_cudnn_plans.py --varlen 2048:65536 2>&1 \
               | tee "$OUT/probe_cudnn.log"
             [ -n "${S62_NIAH:-}" ] && timeout ${S62_NIAH_S:-150} python3 scripts/nb.py niah --ctx $S62_NIAH \
               --json "$OUT/niah.json" 2>&1 | tee "$OUT/niah.log" | tail -14 ;;
    gdnglue) # a GDN prompt chunk's glue in fewer launches (session 62): its CUDA tests, the glue bench (conv builds
             # GLUE_BT, beside .old's module when carried), the 27B prompt grid (PLEN) with .old's tree (carried: the
             # tree before) and then this one, ours only, one process each
             TESTS_S=${TESTS_S:-150} bg_test test_prefill_graphs "${GLUE_K:-captured or final or padded}"
             TESTS_S=${TESTS_S:-150} run_tests test_kernels_gdn_prefill; wait
             bg_report test_prefill_graphs
             B=""; [ -f .old/kernels/gdn_prefill.py ] && B="--baseline .old/kernels/gdn_prefill.py"
             timeout ${GLUE_BENCH_S:-120} python3 scripts/bench_gdn_prefill.py --block-t ${GLUE_BT:-16:8,16:4,32:8,64:8,8:4} \
               $B 2>&1 | tee "$OUT/gdnglue-bench.log" | tail -16
             if [ -f .old/scripts/nb.py ]; then ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
               ( cd .old && timeout ${STAGE_S:-300} python3 scripts/nb.py decode $M27 -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} \
                   --repeats 2 --json "$OUT/gdnglue-old" 2>&1 | tee "$OUT/gdnglue-old.log" | tail -6 ); fi
             nb decode $M27 -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 --json "$OUT/gdnglue-new" 2>&1 \
               | tee "$OUT/gdnglue-new.log" | tail -6 ;;
    cudnn16) # the cuDNN split in fp16 (session 61): the prefill attention's CUDA tests, the bundled model's NIAH grid
             # with --cudnn-prefill on (NIAH_GRID; its floor lowered to the bundled model's head size 64), the 27B
             # prompt grid (PLEN) with it on / off in one process (CUDNNP_ENGINES: add hf for the peer)
             TESTS_S=${TESTS_S:-120} run_tests test_kernels_attention_prefill
             NINFER_BENCH_CUDNN_MIN_HEAD_DIM=8 nb niah --ctx ${NIAH_GRID:-8192,16384,32768,65536} --cudnn-prefill on \
               --json "$OUT/niah_cudnn16.json" \
               2>&1 | tail -12
             nb decode $M27 --engine ${CUDNNP_ENGINES:-ours} -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 \
               --cudnn-prefill on,off --json "$OUT/cudnn16-grid" 2>&1 | tee "$OUT/cudnn16-grid.log" | tail -10 ;;
    fp16b)   # the cuDNN split in fp16 vouched for by the weights (session 72: no host read a chunk and layer): its
             # CUDA tests, then the 27B prompt grid (PLEN) with --cudnn-prefill on,off in this tree and (carried) with
             # it on in .old's (the host read a chunk and layer), in one call
             mkdir -p "$OUT/fp16b"
             timeout ${TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention_prefill.py \
               tests/test_cuda_engine.py -k "cudnn" > "$OUT/fp16b/tests.log" 2>&1
             echo "--- cudnn tests: rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/fp16b/tests.log" | head
             nb decode $M27 -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 --cudnn-prefill on,off \
               --json "$OUT/fp16b/new" 2>&1 | tee "$OUT/fp16b/new.log" | tail -6
             [ -d .old/scripts ] && ( cd .old && timeout ${STAGE_S:-300} python3 scripts/nb.py decode $M27 -p ${PLEN:-2991,65000} \
               -n ${PLEN_N:-32} --repeats 2 --cudnn-prefill on --json "$OUT/fp16b/old" 2>&1 | tee "$OUT/fp16b/old.log" \
               | tail -5 ) ;;
    chunks)  # prompt tokens a prefill forward: the 27B grid (PLEN) at each --prefill-chunk of CHUNKS in one process
             # (one weight build; the peer, CHUNK_ENGINES=ours,hf, once a prompt length)
             mkdir -p "$OUT/chunks"
             nb decode $M27 --engine ${CHUNK_ENGINES:-ours} -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 \
               --prefill-chunk $(echo ${CHUNKS:-2048 4096 8192} | tr ' ' ,) --json "$OUT/chunks/grid" 2>&1 \
               | tee "$OUT/chunks/grid.log" | tail -12 ;;
    lprefill) # layer-major prefill (--layer-prefill, session 57) on and off: its CUDA test, then the 27B prompt grid
             # (PLEN) with --prefill-weights LP_WEIGHTS (auto: taken only where the dense copies do not fit, e.g. an
             # 80 GB card; packed: on any card), same tokens expected
             TESTS_S=${TESTS_S:-150} run_tests test_fastpath
             nb decode $M27 -p ${PLEN:-2991,65000} -n ${PLEN_N:-32} --repeats 2 --prefill-weights ${LP_WEIGHTS:-auto} \
               --layer-prefill on,off --json "$OUT/lprefill" 2>&1 | tail -8 ;;
    pweights) # --prefill-weights packed against the default (dense copies at the 27B shape on an H200): TTFT and
             # memory, same tokens
             for w in auto packed; do
               nb decode $M27 --prefill-weights $w -n 32 --repeats 3 --json "$OUT/pweights-$w.json" 2>&1 | tail -3
             done
             nb concurrency $M27 -c 1,8 -n 128 --prefill-weights dense --json "$OUT/conc27-dense.json" 2>&1 | tail -8 ;;
    ctx262)  # the model's whole native context: a 262,016-token prompt and 128 tokens (262,144 positions), int8 K/V,
             # one repeat after a warm-up on a CTX_WARM-token prompt (default 4,096: the kernels, graphs and buffers at
             # the engine's capacity, without prefilling the long prompt twice; CTX_WARM=0: no warm-up)
             W="--warmup 1 --warmup-prompt ${CTX_WARM:-4096}"; [ "${CTX_WARM:-4096}" = 0 ] && W="--warmup 0"
             nb decode $M27 -p ${CTX_P:-262016} -n 128 --repeats 1 $W --json "$OUT/ctx262.json" 2>&1 | tail -12 ;;
    ncuattn) # Nsight Compute on decode attention's split kernel, int8 beside bf16 (65,536 keys, B = 1, T = 1 by
             # default: NCU_CASES), the default plan (NCU_PLAN: its overrides, bench_attention.py --plan), one report
             # a case; full sections, clocks left alone. NCU_KERNEL: the kernel-name regex (default the Triton split
             # kernel; NCU_KERNEL='^attn_verify$' NCU_CASES=int8:65536:1:8 profiles kernels/attn_cuda.cu's verify)
             if ! command -v ncu >/dev/null; then echo "ncu: not on the PATH"; else
               mkdir -p "$OUT/ncu"   # one folder: it comes back as one archive
               for c in $(echo ${NCU_CASES:-int8:65536:1:1,bf16:65536:1:1} | tr , ' '); do
                 rep="$OUT/ncu/attn_$(echo $c | tr : _)"
                 timeout ${STAGE_S:-300} ncu --clock-control none --kernel-name regex:${NCU_KERNEL:-_attn_split} --launch-skip 2 \
                   --launch-count ${NCU_COUNT:-1} --set full -o "$rep" -f python3 scripts/bench_attention.py --no-sweep \
                   --no-peer --cases $c ${NCU_PLAN:+--plan $NCU_PLAN} > "$rep.log" 2>&1
                 echo "--- $c: ncu rc $?"; grep -E "^==PROF==|Error|error" "$rep.log" | head -5
                 ncu --import "$rep.ncu-rep" --page details --print-units base 2>&1 | grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Executed Ipc A|Shared Memory Configuration Size|L1/TEX Hit|L2 Hit|Block Limit" | head -30
               done
             fi ;;
    pattn)   # prefill attention (kernels/attention_prefill.py): its CUDA tests, then the kernel beside the SDPA path it
             # replaces and torch's flash kernel at the 27B shape, a 2,048-token chunk at several starts (PATTN_ARGS)
             timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/test_kernels_attention_prefill.py \
               2>&1 | tail -3
             timeout ${STAGE_S:-240} python3 scripts/bench_prefill_attention.py ${PATTN_ARGS:---sweep int8} \
               --json "$OUT/pattn.jsonl" 2>&1 | tee "$OUT/pattn.log" | tail -70 ;;
    ptests)  # the engine's prefill paths on CUDA: flash prefill, prefill graphs, the fused path, sampling
             run_tests test_fastpath test_prefill_graphs test_sampler test_cuda_engine test_kernels_gdn_prefill \
               test_kernels_attention_prefill ;;
    dattn)   # decode / verify attention (kernels/attention_triton.py) at the 27B shape: the default plan (tokens packed
             # in one tile) and one token a tile beside SDPA on a bf16 copy, then the launch sweep (DATTN_BUDGET_S)
             timeout ${STAGE_S:-400} python3 scripts/bench_attention.py --budget-s ${DATTN_BUDGET_S:-150} 2>&1 \
               | tee "$OUT/dattn.log" | grep -v "^resources" | tail -60 ;;
    pprof)   # where a long prefill's time goes: scripts/profile_step.py --prefill at PPROF_LEN tokens on the 27B
             # synthetic, once per PPROF_MODES entry (flash: the defaults; sdpa: --no-flash-prefill; unfused:
             # --no-fused-prefill; dense / packed: --prefill-weights dense / packed; cudnn: --cudnn-prefill;
             # chunkN: --prefill-chunk N);
             # PPROF_ARGS adds flags (e.g.
             # "--by-op 30": the torch ops behind the kernels, with their source lines)
             for mode in ${PPROF_MODES:-flash sdpa}; do
               case $mode in
                 flash) flags="" ;;
                 sdpa)  flags="--no-flash-prefill" ;;
                 unfused) flags="--no-fused-prefill" ;;
                 dense) flags="--prefill-weights dense" ;;
                 packed) flags="--prefill-weights packed" ;;
                 cudnn) flags="--cudnn-prefill" ;;
                 chunk[0-9]*) flags="--prefill-chunk ${mode#chunk}" ;;
                 *) echo "pprof: unknown mode $mode"; continue ;;
               esac
               timeout ${STAGE_S:-300} python3 scripts/profile_step.py $M27 --prefill --prompt-len ${PPROF_LEN:-65000} \
                 --top ${PPROF_TOP:-25} $flags ${PPROF_ARGS:-} --json "$OUT/pprof-$mode.json" 2>&1 | tee "$OUT/pprof-$mode.log" \
                 | grep -v "^loaded" | cut -c1-150
             done ;;
    gtrust)  timeout ${STAGE_S:-400} python3 scripts/gate_trust.py --device cuda --pairs ${GT_PAIRS:-100} --repeats 5 \
               --injected-pairs ${GT_INJ:-40} --injected-repeats auto --repeats-budget-s 5 -n 128 --slowdown 0.05 \
               --time-limit-s ${GT_LIMIT_S:-300} --out "$OUT/gate-trust-h200.json" 2>&1 | tee "$OUT/gate_trust.log" \
               | tail -30 ;;
    llwait)  llwait ;;
    cattn)   run_tests ${TEST_FILES:-test_kernels_attn_cuda test_kernels_attention test_cuda_engine}
             timeout ${STAGE_S:-300} python3 scripts/bench_attention.py --budget-s ${CATTN_BUDGET_S:-100} 2>&1 \
               | tee "$OUT/cattn.log" | grep -v "^resources" | tail -70 ;;
    wgv)     # issue 32 item 3: the verify attention on wgmma (kernels/attn_cuda.cu attn_verify_wg, sm_90a, K and V made
             # into fp16 once a block): its CUDA tests (bits against attn_verify's), then the 27B shape's int8 cases
             # (WGV_CASES) with each verify kernel (NINFER_BENCH_ATTN_VERIFY=mma / wgmma); with WGV_E2E=1 the 27B
             # plain and DFlash2 K=7 replayed decode with the wgmma verify (its "= plain" column: the tokens agree)
             mkdir -p "$OUT/wgv"
             [ "${WGV_TESTS:-1}" = 0 ] || timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -rf \
               --tb=line tests/test_kernels_attn_cuda.py -k "wgmma_verify or verify_kernel or tokens_and_rows" 2>&1 \
               | tee "$OUT/wgv/tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|Error" | head -20
             C=int8:8192:1:1,int8:8192:1:8,int8:65536:1:1,int8:65536:1:4,int8:65536:1:8,int8:65536:8:8
             for K in mma wgmma; do echo "--- verify kernel $K"
               NINFER_BENCH_ATTN_VERIFY=$K timeout ${STAGE_S:-150} python3 scripts/bench_attention.py --no-sweep \
                 --no-peer --cases ${WGV_CASES:-$C} 2>&1 | tee "$OUT/wgv/bench-$K.log" | grep -v "^resources" \
                 | tail -14; done
             if [ "${WGV_E2E:-0}" = 1 ]; then
               NINFER_BENCH_ATTN_VERIFY=wgmma nb decode $M27 --spec none,dflash2:7 --replay-acceptance seed -n 64 \
                 --json "$OUT/wgv/d27-wgmma" 2>&1 | tail -8
             fi ;;
    l2flush) l2f="${L2F_OPS:+--ops $L2F_OPS} --rows ${L2F_ROWS:-1}"  # the probe's own ops by default
             timeout 120 python3 scripts/probe_l2_flush.py $l2f 2>&1 | tee "$OUT/probe_l2_flush.log"
             if command -v ncu >/dev/null; then
               timeout 150 ncu --cache-control none --clock-control none --kernel-name regex:qmv \
                 --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
                 python3 scripts/probe_l2_flush.py $l2f --ncu-launches > "$OUT/ncu_l2_flush.log" 2>&1
               echo "--- ncu rc $?"; grep -E "ncu launch|dram__bytes|gpu__time|qmv|==ERR" "$OUT/ncu_l2_flush.log" | head -80
             else echo "ncu: not on the PATH"; fi
             for mode in write read; do tl=""; [ $mode = read ] && tl="--timeline"
               nb kernels --shape qwen3.8-27b --t 1,8 --repeats 30 --kernels v3 --l2-flush $mode $tl \
                 ${KSUITE_OPS:+--ops $KSUITE_OPS} --json "$OUT/kernels_27b_$mode.json" 2>&1 \
                 | tee "$OUT/kernels_27b_$mode.log" | tail -${KSUITE_LINES:-45}; done ;;
    qshape)  specs=${QSHAPE_SPECS:-w4,w4k2,w4k3,w8,w8k2,w8k3,w4b7,w2b12}
             only="ours,$(echo "$specs" | sed 's/\([^,][^,]*\)/ours-\1/g')"
             rm -f "$OUT/qlinear.jsonl"
             for grp in "q5 ${QSHAPE_Q5:-attn.qkv,attn.o}" "q4 ${QSHAPE_Q4:-gdn.out,mlp.down,gdn.z,gdn.qkv}"; do
               set -- $grp
               timeout ${QSHAPE_S:-200} python3 scripts/bench_qlinear.py --no-baselines --pdl --fmts $1 --ops $2 \
                 --ts ${QSHAPE_TS:-1,8} --shape-knobs "$specs" --only "$only" 2>&1 | tee -a "$OUT/qshape.log" \
                 | grep -E "@graph20|FAIL|DIFFER|copy bandwidth|all correct" | head -120
             done
             picked=$(python3 scripts/pick_qmv_shapes.py "$OUT/qlinear.jsonl" --table 2>"$OUT/qshape_pick.log")
             cat "$OUT/qshape_pick.log"; echo "--- picked: NINFER_BENCH_QMV_SHAPES='$picked'"
             if [ -n "$picked" ] && [ "${QSHAPE_E2E:-1}" = 1 ]; then
               for r in $(seq ${QSHAPE_ROUNDS:-1}); do for v in default picked; do
                 sh=""; [ $v = picked ] && sh="$picked"
                 NINFER_BENCH_QMV_SHAPES="$sh" nb decode $M27 --spec none -n 64 --repeats 2 \
                   --json "$OUT/d27-$v-$r" 2>&1 | tee "$OUT/d27-$v-$r.log" \
                   | grep -E "decode tok/s  |roofline|tokens sha|ms / round" | head -8 | sed "s|^|$v $r: |"
               done; done
             fi ;;
    b38)     held_variants none,dflash2:7 new
             for r in $(seq ${B38_REPEATS:-2}); do for d in default ${B38_DROPS:-norm}; do
               a=""; [ $d != default ] && a="--drop $d"
               timeout 120 python3 scripts/profile_step.py --spec none --steps 64 --top 30 $a \
                 --json "$OUT/bprof-$d-$r.json" > "$OUT/bprof-$d-$r.log" 2>&1
               echo "--- bundled step $d, round $r: rc $? $(grep -E 'a step' "$OUT/bprof-$d-$r.log" | head -1)"; done; done
             nb decode $M27 --spec none -n 64 --repeats 2 --json "$OUT/d27plain" 2>&1 | tee "$OUT/d27plain.log" | tail -6
             ;;
    cattn27) for attn in cuda triton; do
               NINFER_BENCH_ATTN=$attn nb decode $M27 -p ${CATTN_P:-2991,65000} -n ${PLEN_N:-128} --repeats 2 \
                 --json "$OUT/cattn27-$attn" 2>&1 | tail -8 | sed "s|^|$attn: |"
             done ;;
    phead)   # a prompt's final prefill chunk picks its first token in the graph (issue 34): the prefill graphs' and
             # the engine's CUDA tests, then the bundled model's prefill drift with this tree and .old's (carried)
             run_tests test_prefill_graphs test_cuda_engine
             for tree in . .old; do
               [ -d "$tree/scripts" ] || continue
               [ "$tree" = . ] || ln -sf "$PWD/models/ninfer-code-small.ninfer" .old/models/ 2>/dev/null
               name=$([ "$tree" = . ] && echo drift || echo drift_old)
               ( cd "$tree" && timeout "${STAGE_S:-200}" python3 scripts/probe_prefill_drift.py --device cuda \
                   --runs ${DRIFT_RUNS:-12} --repeats 5 -n 128 --conditions ${DRIFT_CONDITIONS:-fresh} \
                   --out "$OUT/$name.json" 2>&1 | tail -4 | sed "s|^|$name: |" )
             done ;;
    drift)   nb_py() { timeout "${STAGE_S:-86400}" python3 "$@"; }
             nb_py scripts/probe_prefill_drift.py --device cuda --runs ${DRIFT_RUNS:-40} --repeats 5 -n 128 \
               --conditions ${DRIFT_CONDITIONS:-fresh,shared,fresh-nogc} --out "$OUT/drift.json" 2>&1 | tail -9 ;;
    peersmall) llwait || continue
             export PYTHONPATH=/tmp/llsite:${PYTHONPATH:-}
             nb decode --engine ours,llamacpp --prompt-file suites/data/heldout_prompts.jsonl -n 64 --repeats 2 \
               --json "$OUT/peersmall" 2>&1 | grep -v "^llama_\|^load\|^print_info\|^ggml_\|^graph_\|^sched_" | tail -30 ;;
    *)       echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date +%T)"
