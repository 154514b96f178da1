#!/usr/bin/env bash
# Every H200 figure the README reports, in one detached run. Each run builds in its own copy of the
# checkout under /tmp (never in the folder a device call sends, which the next call replaces):
#   sdpa:  first and alone on the GPU: experiments/sdpa_backends.py (every SDPA kernel on SAM3's attention shapes)
#   attention: alone on the GPU, after sdpa: experiments/attention_kernel.py (the op sam3_aoti::attention against
#          SDPA, every block config) and the GPU tests of the project's Triton ops
#   qkvrope: first and alone on the GPU, no build: the GPU tests of the op sam3_aoti::fp8_linear_rope (and the
#          fp8 ops' AOT compile), experiments/fp8_qkv_rope.py (vit_qkv_rope's fused q, k, v + rotary GEMM against
#          cuBLAS's GEMM and Inductor's rotation) and experiments/fp8_qkv_rope_launches.py (its kernel's launch shapes)
#   raystart: no build, after segment's figures, alone: experiments/ray_start.py --gpu on all the machine's CPUs (a local
#          Ray's start, and segment's pipeline to its first batch with a model actor that imports torch and opens the
#          GPU but loads no package: segment's start-up under the package's own; again with torch preloaded in Ray's
#          workers, and with Ray Data imported beside ray.init). Needs Ray (.whl-ray/a and b)
#   bf16:  full model, random weights: toolchain to verify, then bench (every column, kernel breakdown, load
#          times), then parity with Meta's SAM3 under bf16 autocast
#   fp32:  the same build in fp32, verify; parity with Meta's SAM3 in fp32
#   tuned: the same build tuned: `doit tune` from nothing (at most TUNE_LIMIT s, default 660), then compile with
#          the tuning results (alone on the machine: the compile time with the tuning cache present), verify, and
#          the bench of every column
#   fp8:   first, alone on the GPU: the fp8 GPU tests (scaled products, the fused fc1 kernel and the MLP's AOT
#          compile, pixels through pinned memory), experiments/vit_mlp_fp8.py (one ViT MLP every way),
#          experiments/fp8_aoti_pieces.py and the ViT section compiled alone in bf16 and fp8, each with and without
#          vit_fused_qkv; then precision=fp8
#          (the ViT's linears as fp8 GEMMs but fc2), box_path_attention = "bf16", untuned: verify against the bf16
#          model, then bench (Meta's column and the AOTI ones), parity with Meta, experiments/split_overlap.py on its
#          package (every way of calling its parts in one graph) and the ViT section's costliest kernels at 16 x 1
#          (FP8_KERNELS=0 in the environment: the build, bench, parity, split_overlap and section alone; FP8_LEAN=1:
#          its bench without the by-section tables and no ViT section, for a lease short of device time;
#          BENCH_SHAPES as for segment)
#   compiletime: the bf16 build's compile twice, alone but for tinytuned: cold (an empty Inductor cache), then
#          again with Inductor's and Triton's caches from the first (`doit forget compile`); each index.json
#          (compile_phases: where the time went) to compiled-cold.json and compiled-warm.json
#   tinytuned: tests/test_gpu.py -k tuned (a tuned tiny chain: tune, then compile from its results); its tuning
#          and compile indices and stage logs to tinytuned/
#   o0:    the bf16 build with the wrapper's C++ at -O0 ([compile] inductor aot_inductor.compile_wrapper_opt_level,
#          AOTInductor's default O1): compile time and phases, then bench of the AOTI columns at 1 x 1 and 2 x 3
#          (the plain runner is the one whose launches the wrapper's code makes), then verify
#   parity: the bf16 build as pipeline.toml has it: verify, then parity with Meta's SAM3 under bf16 autocast
#          (the bf16 run without its bench)
#   loader: the bf16 build as pipeline.toml has it (untuned), verify, then the bench's AOTI + CUDA graphs column
#          with every loader's load time: the runtime's own unpacking of a package (sam3_aoti.runtime.loader) at
#          full size
#   cache: the binary cache, as a fleet uses it (scripts/cache_figures.py turns its timings into cache.md/json):
#          checkout A, a fresh box, builds the bf16 package (toolchain to render) pushing to a folder cache;
#          fresh clone B (empty Inductor cache) substitutes from the folder, then loads and runs the package;
#          clone C does the same over S3 (rclone serve s3 of that folder on 127.0.0.1); clone D, a new weights
#          seed, substitutes the compile and re-packages. A pushes signed by a key made here; B, C, D trust it.
#   fresh: a fresh box with no cache at all: the bf16 package from nothing, toolchain to render (timings.tsv), on the
#          pinned toolkit (TOOLKIT=machine: the machine's)
#   split: the same with [export] split on for sam3 (the model also as encode_image, encode_text, decode),
#          then (once every other run has ended) bench of the eager and AOTI columns (SPLIT_COLUMNS, a TOML
#          list, picks others), with the split models' table, then parity with Meta's SAM3 under bf16 autocast
#   exemplars: the bf16 split package from nothing, verify with the exemplar-box cases, the bench's AOTI + CUDA
#          graphs column at 1 x 1, 2 x 3, 1 x 16 (the box rows), parity with Meta's SAM3 (box cases included)
#   optimizations: no build: the sections [export] optimizations touch (DETR encoder, decoder, mask decoder; OPTIMIZATIONS_SECTIONS,
#          comma-separated, picks others) compiled alone at 1 x 1 and 1 x 16 (OPTIMIZATIONS_SHAPES picks others)
#          without them (or with OPTIMIZATIONS_BASE's, a TOML list) and with pipeline.toml's (or OPTIMIZATIONS_ON's)
#          (scripts/checks/section_times.py; the 8 costliest kernels, OPTIMIZATIONS_KERNELS picks another count),
#          then eager parity with them
#   heads: no build: the per-pair sections (and the text encoder) each compiled alone at 1 x 1 and 1 x 16 with their
#          costliest kernels (scripts/checks/section_times.py), as pipeline.toml has them and with the DETR decoder's linears
#          in fp32 ([export] box_path_linears); then both recipes in eager against Meta's SAM3 under bf16 autocast
#          (scripts/checks/parity_eager.py, the parity tolerances)
#   segment: the bf16 build as pipeline.toml has it (untuned), verify, the bench's AOTI + CUDA graphs column with
#          every loader's load time (the service's start), then `doit throughput`: `sam3-aoti segment` on Ray Data
#          over the [throughput] collection (mixed sizes, PNGs and JPEGs, broken files) against that bench's 16 x 1
#          images/s, the GPU's busy share sampled (on N GPUs: one actor, then N, against N times one), then an
#          actor's time by step without Ray
#          (scripts/checks/segment_actor.py). With fresh named too, it builds nothing: bench, throughput and the
#          actor's steps run on fresh's package once the fresh box is timed (BENCH_SHAPES="[[16, 1]]" in the
#          environment benches that shape alone, for a lease short of device time). Needs Ray: .whl-ray/a carried on one call, .whl-ray/b on the next (scripts/fetch_gpu_wheels.sh).
#          Then scripts/checks/segment_startup.py on that package, SEGMENT_STARTUP_RUNS times (default 5; 0: not):
#          segment's start-up as a median, where one throughput run gives one sample.
#          SEGMENT_LEAN=1: without segment's own build's verify and the actor's steps; THROUGHPUT_COPIES=N:
#          [throughput] copies (as BENCH_SHAPES, for fresh's package or segment's own).
#          With .runtime-before carried (`git archive f078bd9 src | tar -x -C .runtime-before`: the loader before
#          the one-open-file check), the next start under both loaders (scripts/compare_load_times.py)
#   kernels: no build: the fp8 run's GPU tests and measurements (fp8_kernels), last, alone on the GPU (after every
#          bench), for a run that measures other runs and cannot spare an fp8 build
#   windoworder: no build, alone: the ViT section compiled alone (1 x 1 and 16 x 1) in bf16 and fp8, without and with
#          vit_window_order, then eager parity with Meta's SAM3 under bf16 autocast with it on (WINDOW_ORDER_PARITY=0
#          in the environment: the sections alone; WINDOW_ORDER_PRECISIONS="fp8 bf16": that order;
#          WINDOW_ORDER_CONFIGS=window-order.toml: with it alone)
#   freshbench: after fresh (named with it): fresh's package benched at every shape (BENCH_SHAPES picks others),
#          Meta's column and the AOTI + CUDA graphs one, no sections: the bf16 figures beside fp8's
#   windowpackage: after fresh (named with it, or alone on a warm lease whose fresh run has ended): fresh's
#          checkout copied, vit_window_order added to [export] optimizations (every precision), the bf16 package
#          built again from export on (fresh's weights, toolchain and Inductor cache kept), then benched as fresh's
#          is: the package's own call with and without it, at fresh's shapes (BENCH_SHAPES), on one machine
#   again: no build, alone: this checkout's src/ and scripts/ copied over the package an earlier fresh or segment
#          run of this machine built (a warm lease), then `doit -s throughput` and the actor's steps again
#          (ACTOR_CPUS=N in the environment: the throughput's actor holds N CPUs, `[throughput] actor_cpus`)
#   actors: the tiny package on CUDA, then scripts/checks/segment_actor.py (a segment actor's steps, no Ray) with
#          this checkout's code and, when carried, .runtime-before's (`git archive REV src scripts | tar -x -C
#          .runtime-before`), in turn, twice: the actor's own overhead, where a tiny model leaves little else
#   ceiling: the tiny package on CUDA (built beside the other runs), then, after segment's figures and alone,
#          `doit throughput` with it: segment's Ray pipeline with a model of about 0.1 ms an image, the most images/s
#          the pipeline itself delivers on this machine; then the GPU test of segment's overlapping calls on that
#          package. `start again ceiling` runs both again with this checkout's code
#   fc1:   no build, after segment's and ceiling's figures, alone: experiments/fp8_fc1_fused.py (the ViT MLP's fc1, bias,
#          GELU and group quantization as one Triton fp8 GEMM, every launch shape, against today's two kernels)
#   vitattn: no build, after fc1, alone: experiments/vit_attention.py (the ViT's windowed and global attentions, 576
#          and 5,184 tokens, head dim 64, at 1 and 16 images: SDPA's kernels against the project's Triton kernel and a
#          TMA one)
#   vitblock: no build, after vitattn, alone: experiments/vit_block.py (one ViT layer, windowed and global, at 16
#          images: transformers' SDPA, vit_attention_kernel, and the candidates beside it)
#   vitnorm: no build, after vitblock, alone: experiments/vit_norm_fp8.py (precision=fp8's residual + LayerNorm +
#          e4m3 rows at 16 images: Inductor's kernels, Inductor with persistent reductions, one Triton kernel)
#   tiny:  the default chain of the tiny profile on CUDA (`doit device=cuda`), the GPU tests that use its
#          package (CUDA graphs vs the plain runner), then the C++ consumer on its package
# Every build uses the pinned pip toolkit (.cuda-whl: .cuda-whl/rest on one call, .cuda-whl/nvvm/a and b on two
# more) with the machine's own toolkit out of sight (no CUDA_HOME, nothing named cuda on PATH); TOOLKIT=machine in
# the environment uses the machine's own from the start. Where the pinned toolchain fails, a build falls back to toolkit=machine (the build's log
# and toolkit.txt say so), so the other figures still come. A full build whose compile fails with the masked
# attentions on SDPA is retried once with them eager (pipeline.toml [export] masked_attention; its log says).
# Builds share the machine's cores, so compile times are upper bounds; benches run after the builds, and the
# runs that only time (heads, optimizations) after the benches, one after the other.
# The device tool ends a call after 10 minutes, so the run is detached and polled:
#   scripts/gpu_full.sh start [RUN...]    start it (setsid) with the runs named (default: bf16 tiny)
#   scripts/gpu_full.sh wait SECS         wait until it ends or SECS pass, then pack reports and logs into
#                                         $OUT/h200-results.tar.gz (whatever exists so far) and print the status
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=/tmp/sam3-aoti-results
WORK=/tmp/sam3-aoti
SAM3="profile=sam3 weights=random device=cuda"

hidden_path() { tr ':' '\n' <<< "$PATH" | grep -v cuda | paste -sd:; }

hidden() {  # hidden COMMAND...: with the machine's CUDA toolkit out of sight
    env -u CUDA_HOME -u CUDA_PATH PATH="$(hidden_path)" "$@"
}

toolkit_for() {  # toolkit_for RUN ARGS...: the pinned toolchain, hidden; else toolkit=machine; the choice goes to toolkit.txt
    local name=$1
    shift
    if [[ ${TOOLKIT:-pinned} != machine ]] && step "$name-toolchain" hidden scripts/gpu_run.sh toolchain "$@"; then
        echo toolkit=pinned > toolkit.txt
    else step "$name-toolchain-machine" scripts/gpu_run.sh toolchain "$@" toolkit=machine; echo toolkit=machine > toolkit.txt
    fi
}

build() {  # build NAME ARGS...: doit with the toolkit toolkit_for chose (hidden when pinned)
    local name=$1 toolkit
    shift
    toolkit=$(cat toolkit.txt)
    local run=(scripts/gpu_run.sh "$@" "$toolkit")
    [[ $toolkit == toolkit=pinned ]] && run=(env -u CUDA_HOME -u CUDA_PATH PATH="$(hidden_path)" "${run[@]}")
    [[ -n ${LIMIT:-} ]] && run=(limited "$LIMIT" "${run[@]}")
    step "$name" "${run[@]}"
}

short_lease() {  # this checkout's [bench] shapes and [throughput] copies as BENCH_SHAPES (a TOML list, e.g.
    # "[[16, 1]]": the shape segment is held to) and THROUGHPUT_COPIES say, for a lease short of device time
    [[ -z ${BENCH_SHAPES:-} ]] || sed -i "/^\[bench\]/,/^\[/ s|^shapes = .*|shapes = $BENCH_SHAPES|" pipeline.toml
    [[ -z ${THROUGHPUT_COPIES:-} ]] || configure copies "$THROUGHPUT_COPIES"
}

configure() {  # configure KEY VALUE...: set keys of this checkout's pipeline.toml (each key is there once)
    while (($# >= 2)); do sed -i "s|^$1 = .*|$1 = $2|" pipeline.toml; shift 2; done
}

limited() {  # limited SECONDS COMMAND...: the command in its own process group, killed whole after SECONDS
    local secs=$1 pid watcher rc
    shift
    setsid "$@" & pid=$!
    (sleep "$secs"; kill -- -"$pid" 2>/dev/null) & watcher=$!
    wait "$pid"; rc=$?
    kill "$watcher" 2>/dev/null
    return $rc
}

step() {  # step NAME COMMAND...: log to RESULTS/NAME.log, start and end times to RESULTS/status
    local name=$1 rc
    shift
    echo "$(date +%T) start $name" >> "$RESULTS/status"
    "$@" > "$RESULTS/$name.log" 2>&1
    rc=$?
    echo "$(date +%T) end $name rc=$rc" >> "$RESULTS/status"
    return $rc
}

checkout() {  # checkout RUN: a fresh copy of this checkout (with .whl) at $WORK/RUN
    rm -rf "${WORK:?}/$1" && mkdir -p "$WORK/$1"
    tar --exclude=./artifacts -cf - . | tar -xf - -C "$WORK/$1"
}

full_build() {  # full_build RUN PRECISION: toolchain to verify; once more with eager masked attention if that fails
    local name=$1 precision=$2
    cd "$WORK/$name" && toolkit_for "$name" $SAM3 precision="$precision"
    build "$name-build" weights export compile package verify $SAM3 precision="$precision" && return 0
    sed 's/^masked_attention = "sdpa"$/masked_attention = "eager"/' pipeline.toml > eager-attention.toml
    build "$name-build-eager-attention" weights export compile package verify $SAM3 precision="$precision" \
        config=eager-attention.toml
}

AOTI_ONLY=(columns '["aoti", "aoti_graphs"]' load_times false)  # the eager columns come from the tuned bench

loader_run() {
    cd "$WORK/loader" && configure columns '["aoti_graphs"]' enabled false
    toolkit_for loader $SAM3 precision=bf16
    build loader-build weights export compile package verify $SAM3 precision=bf16
}

fp8_run() {  # its bench has Meta's column beside the AOTI ones: #50's goals are claimed for this build
    cd "$WORK/fp8" && configure box_path_attention '"bf16"' enabled false \
        columns '["meta", "aoti", "aoti_graphs", "aoti_graphs_whole"]' load_times false
    [[ ${FP8_LEAN:-0} == 1 ]] && configure sections '"off"'
    short_lease  # BENCH_SHAPES: the shapes its bench times
    toolkit_for fp8 $SAM3 precision=fp8
    build fp8-build weights export compile package verify $SAM3 precision=fp8
}

tuned_run() {  # export, then the tuning from nothing, next to the other builds (its time is an upper bound)
    cd "$WORK/tuned" && configure box_path_attention '"bf16"' enabled true
    toolkit_for tuned $SAM3 precision=bf16
    build tuned-export weights export $SAM3 precision=bf16 || return 1
    LIMIT=${TUNE_LIMIT:-660} build tuned-tune tune $SAM3 precision=bf16
}

after() {  # after RUN PRECISION STAGE...: alone on the machine, each stage on the run's finished build
    local name=$1 precision=$2 config=pipeline.toml stage
    shift 2
    cd "$WORK/$name" || return 1
    [[ -f eager-attention.toml ]] && config=eager-attention.toml  # the build that compiled (full_build)
    for stage in "$@"; do build "$name-$stage" "$stage" $SAM3 precision="$precision" config=$config; done
}

segment_run() {  # with fresh named too, no build of its own: it times fresh's package once that is built
    [[ $runs == *" fresh "* ]] && return 0
    cd "$WORK/segment" && configure columns '["aoti_graphs"]' sections '"off"' enabled false && short_lease
    toolkit_for segment $SAM3 precision=bf16
    local stages=(weights export compile package verify)
    [[ ${SEGMENT_LEAN:-0} == 1 ]] && stages=(weights export compile package)  # a lease short of device time
    build segment-build "${stages[@]}" $SAM3 precision=bf16
}

tiny_run() {  # the default chain, as `uv run doit` runs it on a GPU machine (pinned toolkit, machine's hidden)
    cd "$WORK/tiny" || return 1
    if [[ ${TOOLKIT:-pinned} == machine ]]; then step tiny-chain scripts/gpu_run.sh device=cuda toolkit=machine
    else step tiny-chain hidden scripts/gpu_run.sh device=cuda; fi
    step tiny-gpu-tests scripts/gpu_run.sh --pytest -q tests/test_gpu.py -k "not parity and not tiny_pipeline and not tuned"
    local package=$WORK/tiny/artifacts/tiny-fp32-cuda/package/sam3.pt2
    step tiny-cpp-consumer bash -c "cmake -S examples/cpp -B $WORK/cpp-build \
        -DCMAKE_PREFIX_PATH=\$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') \
        && cmake --build $WORK/cpp-build -j8 && $WORK/cpp-build/sam3_consumer $package"
}

timed() {  # timed NAME COMMAND...: step, and its wall time to RESULTS/timings.tsv
    local name=$1 t0 rc
    shift
    t0=$(date +%s.%N)
    step "$name" "$@"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$(awk "BEGIN {printf \"%.1f\", $(date +%s.%N) - $t0}")" "$rc" >> "$RESULTS/timings.tsv"
    return $rc
}

cache_run() {
    local fleet=/tmp/sam3-fleet keys=$WORK/cache-keys package=artifacts/sam3-bf16-cuda/package/sam3.pt2 clone
    rm -rf "$fleet" "$keys" && mkdir -p "$fleet/store" "$keys"
    for clone in cacheB cacheC cacheD; do checkout $clone; done
    cd "$WORK/cacheA" || return 1
    scripts/gpu_run.sh --python -m sam3_aoti cache keygen h200-builder --out "$keys/builder.key" > "$keys/builder.pub" || return 1
    export SAM3_AOTI_TRUSTED_KEYS=$(cat "$keys/builder.pub")
    timed cache-A-fresh-box env SAM3_AOTI_SIGNING_KEY="$keys/builder.key" scripts/gpu_run.sh $SAM3 precision=bf16 \
        toolkit=machine cache="$fleet/store" || return 1
    cd "$WORK/cacheB" && timed cache-B-folder scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine cache="$fleet/store"
    timed cache-B-load scripts/gpu_run.sh --python scripts/load_once.py "$package"
    cmp "$WORK/cacheA/$package" "$package" > "$RESULTS/cache-B-cmp.txt" 2>&1 && echo identical >> "$RESULTS/cache-B-cmp.txt"
    local port=18777 rclone
    rclone=$(PATH=/tmp/sam3-cache-site/bin:$PATH command -v rclone)
    if [[ -n $rclone ]]; then
        "$rclone" serve s3 --config /dev/null --addr 127.0.0.1:$port --auth-key h200fleet,h200fleetsecret "$fleet" \
            > "$RESULTS/rclone.log" 2>&1 & local server=$!
        sleep 2
        cd "$WORK/cacheC" && timed cache-C-s3 env AWS_ACCESS_KEY_ID=h200fleet AWS_SECRET_ACCESS_KEY=h200fleetsecret \
            AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_DEFAULT_REGION=us-east-1 \
            scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine cache=s3://store
        cmp "$WORK/cacheA/$package" "$package" > "$RESULTS/cache-C-cmp.txt" 2>&1 && echo identical >> "$RESULTS/cache-C-cmp.txt"
        timed cache-C-load scripts/gpu_run.sh --python scripts/load_once.py "$package"
        kill $server
    fi
    cd "$WORK/cacheD" && configure seed 1
    timed cache-D-new-seed scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine cache="$fleet/store"
    (cd "$WORK/cacheA" && scripts/gpu_run.sh --python scripts/cache_figures.py "$RESULTS" > "$RESULTS/cache.md")
}

split_run() {  # the bf16 package with the split models ([export] split), from nothing (its bench: run_all)
    local columns=${SPLIT_COLUMNS:-'["meta", "transformers", "aoti", "aoti_graphs"]'}
    cd "$WORK/split" && configure split '["tiny", "sam3"]' columns "$columns" load_times false
    timed split-build scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine
}

exemplars_run() {  # the bf16 split package from nothing, its verify with the exemplar-box cases of cases.toml, then
    # the bench's AOTI + CUDA graphs column at 1 x 1, 2 x 3 and 1 x 16 (the box rows beside the text-only ones; no
    # sections) and parity with Meta's SAM3 under bf16 autocast, the box cases included
    cd "$WORK/exemplars" && configure split '["tiny", "sam3"]' columns '["aoti_graphs"]' load_times false \
        sections '"off"'
    sed -i 's/^shapes = \[\[1, 1\], \[2, 3\], \[4, 4\], \[16, 1\], \[1, 16\]\]/shapes = [[1, 1], [2, 3], [1, 16]]/' pipeline.toml
    timed exemplars-build scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine || return 1
    step exemplars-bench scripts/gpu_run.sh bench $SAM3 precision=bf16 toolkit=machine
    step exemplars-parity scripts/gpu_run.sh parity $SAM3 precision=bf16 toolkit=machine
}

optimizations_run() {  # no build: the sections [export] optimizations touch, with the base (OPTIMIZATIONS_BASE) and all; eager parity
    local sections=${OPTIMIZATIONS_SECTIONS:-"DETR encoder,DETR decoder,mask decoder"} times=(--python scripts/checks/section_times.py
        --profile sam3 --precision bf16 --device cuda --shapes "${OPTIMIZATIONS_SHAPES:-1x1,1x16}" --kernels "${OPTIMIZATIONS_KERNELS:-8}")
    cd "$WORK/optimizations" && sed "s|^optimizations = .*|optimizations = ${OPTIMIZATIONS_BASE:-[]}|" pipeline.toml > base-optimizations.toml
    [[ -n ${OPTIMIZATIONS_ON:-} ]] && sed -i "s|^optimizations = .*|optimizations = $OPTIMIZATIONS_ON|" pipeline.toml
    step optimizations-weights scripts/gpu_run.sh weights $SAM3 precision=bf16 toolkit=machine || return 1
    step optimizations-sections-off scripts/gpu_run.sh "${times[@]}" --sections "$sections" --config base-optimizations.toml \
        --out "$RESULTS/optimizations-off"
    step optimizations-sections-on scripts/gpu_run.sh "${times[@]}" --sections "$sections" --out "$RESULTS/optimizations-on"
    step optimizations-parity scripts/gpu_run.sh --python scripts/checks/parity_eager.py $SAM3 precision=bf16
}

heads_run() {
    local sections="DETR encoder,DETR decoder,mask decoder,scoring,text encoder" times=(--python scripts/checks/section_times.py
        --profile sam3 --precision bf16 --device cuda --shapes 1x1,1x16 --kernels 12)
    cd "$WORK/heads" && sed 's|^box_path_linears = .*|box_path_linears = "fp32"|' pipeline.toml > fp32-linears.toml
    step heads-weights scripts/gpu_run.sh weights $SAM3 precision=bf16 toolkit=machine || return 1
    step heads-sections scripts/gpu_run.sh "${times[@]}" --sections "$sections" --out "$RESULTS/heads"
    step heads-sections-fp32-linears scripts/gpu_run.sh "${times[@]}" --sections "DETR decoder" --config fp32-linears.toml \
        --out "$RESULTS/heads-fp32-linears"
    step heads-parity scripts/gpu_run.sh --python scripts/checks/parity_eager.py $SAM3 precision=bf16
    step heads-parity-fp32-linears scripts/gpu_run.sh --python scripts/checks/parity_eager.py $SAM3 precision=bf16 \
        config=fp32-linears.toml
}

stamped() {  # stamped TIMELINE COMMAND...: the command's output as it is, and each line with its second to TIMELINE
    local timeline=$1
    shift
    "$@" 2>&1 | python3 -u -c 'import sys, time
t0, timeline = time.monotonic(), open(sys.argv[1], "w")
for line in sys.stdin:
    sys.stdout.write(line)
    timeline.write(f"{time.monotonic() - t0:7.1f} {line}")
    timeline.flush()' "$timeline"
    return "${PIPESTATUS[0]}"
}

fresh_run() {  # the default chain as a user runs it, on the pinned toolkit with the machine's hidden (TOOLKIT=machine:
    # the machine's); the timeline says where the seconds between the stages' own clocks go
    local run=(hidden scripts/gpu_run.sh $SAM3 precision=bf16) toolkit=toolkit=pinned
    [[ ${TOOLKIT:-pinned} == machine ]] &&
        run=(scripts/gpu_run.sh $SAM3 precision=bf16 toolkit=machine) toolkit=toolkit=machine
    env | grep '^PYTHON' | sort > "$RESULTS/fresh-python-env.txt"
    cd "$WORK/fresh" && echo "$toolkit" > toolkit.txt  # what the runs after it build with
    timed fresh-box stamped "$RESULTS/fresh-box.timeline" "${run[@]}"
    scripts/gpu_run.sh --python scripts/cache_figures.py "$RESULTS" > "$RESULTS/cache.md"
}

compiletime_run() {
    local variant=$WORK/compiletime/artifacts/sam3-bf16-cuda
    cd "$WORK/compiletime" && configure enabled false
    toolkit_for compiletime $SAM3 precision=bf16
    build compiletime-export weights export $SAM3 precision=bf16 || return 1
    build compiletime-cold compile $SAM3 precision=bf16 && cp "$variant/compiled/index.json" "$RESULTS/compiled-cold.json"
    build compiletime-forget forget compile $SAM3 precision=bf16
    build compiletime-warm compile $SAM3 precision=bf16 && cp "$variant/compiled/index.json" "$RESULTS/compiled-warm.json"
}

o0_run() {
    cd "$WORK/o0" && configure enabled false "${AOTI_ONLY[@]}"
    sed -i '/^\[bench\]/,/^\[/ s|^shapes = .*|shapes = [[1, 1], [2, 3]]|' pipeline.toml
    sed -i '0,/^inductor = {}$/s//inductor = { "aot_inductor.compile_wrapper_opt_level" = "O0" }/' pipeline.toml
    toolkit_for o0 $SAM3 precision=bf16
    build o0-build weights export compile package $SAM3 precision=bf16 || return 1
    build o0-bench bench $SAM3 precision=bf16
    build o0-verify verify $SAM3 precision=bf16
}

tinytuned_run() {
    local tmp=$WORK/tinytuned-tmp toolkit=()
    [[ ${TOOLKIT:-pinned} == machine ]] && toolkit=(SAM3_AOTI_TEST_TOOLKIT=machine)
    cd "$WORK/tinytuned" && rm -rf "$tmp"
    step tinytuned-test limited 900 env "${toolkit[@]}" scripts/gpu_run.sh --pytest -q tests/test_gpu.py -k tuned --basetemp="$tmp"
    mkdir -p "$RESULTS/tinytuned"
    (cd "$tmp" && find . \( -path '*/logs/*' -o -path '*/tuning/index.json' -o -path '*/compiled/index.json' \
        -o -name report.md \) -print0 | tar --null -T - -cf -) | tar -xf - -C "$RESULTS/tinytuned"
}

fp8_kernels() {  # the fp8 GPU tests, one ViT MLP timed every way (experiments/vit_mlp_fp8.py), which fp8 pieces
    # AOTInductor runs (experiments/fp8_aoti_pieces.py) and the ViT section in bf16 and fp8 (no build)
    step fp8-gpu-test scripts/gpu_run.sh --pytest -q tests/test_fp8.py \
        tests/test_gpu.py -k "scaled_mm or aot_compile or fp8_fc1 or pinned_memory or one_copy"
    step vit-mlp-fp8 scripts/gpu_run.sh --python experiments/vit_mlp_fp8.py --out "$RESULTS/vit-mlp-fp8"
    step fp8-aoti-pieces scripts/gpu_run.sh --python experiments/fp8_aoti_pieces.py
    local precision config
    sed 's/"vit_fused_qkv", //' pipeline.toml > without-fused-qkv.toml  # the lever of 2026-12-06, measured against
    for precision in bf16 fp8; do
        for config in pipeline.toml without-fused-qkv.toml; do
            step "vit-section-$precision-${config%.toml}" scripts/gpu_run.sh --python scripts/checks/section_times.py \
                --profile sam3 --precision "$precision" --device cuda --shapes 1x1,16x1 --sections ViT --kernels 16 \
                --config "$config" --out "$RESULTS/vit-section-$precision-${config%.toml}"
        done
    done
}

window_order_on() {  # window_order_on [-i] FILE: vit_window_order named in [export] optimizations, after vit_fused_qkv
    sed "${@:1:$#-1}" 's/"vit_fused_qkv", /"vit_fused_qkv", "vit_window_order", /' "${@: -1}"
}

window_order_run() {  # no build: the ViT section in bf16 and fp8 without and with vit_window_order; eager parity with it
    local precision config
    # off: named nowhere (neither in optimizations nor in precision_optimizations); on: in optimizations too
    sed -e 's/"vit_window_order", //g' -e 's/, "vit_window_order"//g' -e 's/"vit_window_order"//g' pipeline.toml \
        > window-order-off.toml
    window_order_on window-order-off.toml > window-order.toml
    for precision in ${WINDOW_ORDER_PRECISIONS:-bf16 fp8}; do
        for config in ${WINDOW_ORDER_CONFIGS:-window-order-off.toml window-order.toml}; do
            step "vit-section-$precision-${config%.toml}" scripts/gpu_run.sh --python scripts/checks/section_times.py \
                --profile sam3 --precision "$precision" --device cuda --shapes 1x1,16x1 --sections ViT --kernels 16 \
                --config "$config" --out "$RESULTS/vit-section-$precision-${config%.toml}"
        done
    done
    [[ ${WINDOW_ORDER_PARITY:-1} == 0 ]] && return 0  # a lease short of device time: the sections alone
    step window-order-weights scripts/gpu_run.sh weights $SAM3 precision=bf16 toolkit=machine || return 1
    step window-order-parity scripts/gpu_run.sh --python scripts/checks/parity_eager.py $SAM3 precision=bf16 \
        config=window-order.toml
}

window_package_run() {  # fresh's package again with vit_window_order in [export] optimizations, then its bench
    [[ -f $WORK/fresh/artifacts/sam3-bf16-cuda/package/sam3.pt2 ]] ||
        { echo "windowpackage: no fresh package here (name fresh with it)" >> "$RESULTS/status"; return 1; }
    rm -rf "$WORK/windowpackage" && cp -a "$WORK/fresh" "$WORK/windowpackage"
    (cd "$WORK/windowpackage" && window_order_on -i pipeline.toml &&
        build windowpackage-build package $SAM3 precision=bf16 && build windowpackage-bench bench $SAM3 precision=bf16)
}

ray_logs() {  # ray_logs NAME: the last Ray session's Ray Data logs (its operators' progress, where the start-up went)
    mkdir -p "$RESULTS/$1-ray" && cp -r /tmp/ray/session_latest/logs/ray-data "$RESULTS/$1-ray/" 2>/dev/null
}

actor_cpus() {  # actor_cpus CHECKOUT: ACTOR_CPUS (when set) as that checkout's [throughput] actor_cpus
    [[ -n ${ACTOR_CPUS:-} ]] || return 0
    sed -i '/^actor_cpus = /d' "$1/pipeline.toml" && sed -i "/^\[throughput\]/a actor_cpus = $ACTOR_CPUS" "$1/pipeline.toml"
}

again_run() {  # no build: this checkout's src/ and scripts/ over an earlier fresh or segment run's package here
    local dir package=artifacts/sam3-bf16-cuda/package/sam3.pt2
    for dir in "$WORK/fresh" "$WORK/segment"; do [[ -f $dir/$package ]] && break; done
    [[ -f $dir/$package ]] || { echo "again: no package here (a fresh or segment run first)" >> "$RESULTS/status"; return 1; }
    rm -rf "${dir:?}/src" "$dir/scripts" && cp -r src scripts "$dir/"
    actor_cpus "$dir"
    cd "$dir" && build segment-throughput -s throughput $SAM3 precision=bf16
    ray_logs segment-throughput
    step segment-actor scripts/gpu_run.sh --python scripts/checks/segment_actor.py "$package" --images 64 \
        --out "$RESULTS/segment-actor"
}

ceiling_again() {  # this checkout's src/ over an earlier ceiling run's tiny package here, its throughput again
    [[ -f $WORK/ceiling/artifacts/tiny-fp32-cuda/package/sam3.pt2 ]] || return 1
    rm -rf "$WORK/ceiling/src" && cp -r src "$WORK/ceiling/" && actor_cpus "$WORK/ceiling" && (cd "$WORK/ceiling" && build ceiling-throughput -s \
        throughput profile=tiny device=cuda)
}

actors_run() {  # the tiny package on CUDA, then a segment actor's steps without Ray, this checkout's code and the
    # code in .runtime-before (src/ and scripts/ of another commit, when carried) in turn, twice
    local package=artifacts/tiny-fp32-cuda/package/sam3.pt2 i
    cd "$WORK/actors" && toolkit_for actors profile=tiny device=cuda
    build actors-build package profile=tiny device=cuda || return 1
    for i in 1 2; do
        step "actor-now-$i" scripts/gpu_run.sh --python scripts/checks/segment_actor.py "$package" --images 64 \
            --out "$RESULTS/actor-now-$i"
        [[ -f .runtime-before/scripts/checks/segment_actor.py ]] && step "actor-before-$i" scripts/gpu_run.sh --python \
            .runtime-before/scripts/checks/segment_actor.py "$package" --images 64 --out "$RESULTS/actor-before-$i"
    done
}

ceiling_build() {  # the tiny package on CUDA, for ceiling_throughput
    cd "$WORK/ceiling" && toolkit_for ceiling profile=tiny device=cuda
    build ceiling-build package profile=tiny device=cuda
}

ceiling_throughput() {  # segment's own ceiling: its Ray pipeline over the throughput collection with a model that
    # leaves the GPU all but idle (the tiny package: about 0.1 ms an image), alone on the machine
    (cd "$WORK/ceiling" && build ceiling-throughput throughput profile=tiny device=cuda && ray_logs ceiling-throughput &&
        step ceiling-gpu-test scripts/gpu_run.sh --pytest -q tests/test_gpu.py -k overlapping)
}

run_all() {
    local runs=" $* " pids=()
    [[ $runs == " again " ]] && { again_run; return 0; }
    [[ $runs == " again ceiling " ]] && { (again_run); ceiling_again; return 0; }
    [[ $runs == " windowpackage " ]] && { window_package_run; return 0; }  # alone: after a fresh run of this machine
    for name in sdpa attention qkvrope raystart bf16 fp32 parity tuned fp8 loader segment actors ceiling fc1 vitattn vitblock vitnorm tiny compiletime tinytuned o0 cache fresh split exemplars kernels windoworder heads optimizations; do [[ $runs == *" $name "* ]] && checkout "${name/#cache/cacheA}"; done
    local first=$1
    [[ $first == cache ]] && first=cacheA
    (cd "$WORK/$first" && step install-wheels scripts/gpu_run.sh --python -c "") || return 1  # once, for all runs
    [[ $runs == *" sdpa "* ]] && (cd "$WORK/sdpa" && step sdpa-backends scripts/gpu_run.sh --python \
        experiments/sdpa_backends.py --json "$RESULTS/sdpa-backends.json")
    [[ $runs == *" attention "* ]] && (cd "$WORK/attention" && step attention-kernel scripts/gpu_run.sh --python \
        experiments/attention_kernel.py --out "$RESULTS/attention"; step attention-gpu-tests scripts/gpu_run.sh --pytest \
        -q tests/test_gpu.py -k "attention_kernel or box_bias_kernel")
    [[ $runs == *" qkvrope "* ]] && (cd "$WORK/qkvrope" &&
        step qkv-rope-gpu-test scripts/gpu_run.sh --pytest -q tests/test_gpu.py tests/test_fp8.py -k "qkv_rope or aot_compile"
        step fp8-qkv-rope scripts/gpu_run.sh --python experiments/fp8_qkv_rope.py --out "$RESULTS/fp8-qkv-rope"
        step fp8-qkv-rope-launches scripts/gpu_run.sh --python experiments/fp8_qkv_rope_launches.py)
    [[ $runs == *" fp8 "* && ${FP8_KERNELS:-1} == 1 ]] && (cd "$WORK/fp8" && fp8_kernels)  # FP8_KERNELS=0: the build alone
    [[ $runs == *" bf16 "* ]] && { full_build bf16 bf16 & pids+=($!); }
    [[ $runs == *" fp32 "* ]] && { full_build fp32 fp32 & pids+=($!); }
    [[ $runs == *" parity "* ]] && { full_build parity bf16 & pids+=($!); }
    [[ $runs == *" tuned "* ]] && { tuned_run & pids+=($!); }
    [[ $runs == *" fp8 "* ]] && { fp8_run & pids+=($!); }
    [[ $runs == *" loader "* ]] && { loader_run & pids+=($!); }
    [[ $runs == *" segment "* ]] && { segment_run & pids+=($!); }
    [[ $runs == *" tiny "* ]] && { tiny_run & pids+=($!); }
    [[ $runs == *" actors "* ]] && { actors_run & pids+=($!); }
    [[ $runs == *" ceiling "* ]] && { ceiling_build & pids+=($!); }
    [[ $runs == *" compiletime "* ]] && { compiletime_run & pids+=($!); }
    [[ $runs == *" tinytuned "* ]] && { tinytuned_run & pids+=($!); }
    [[ $runs == *" o0 "* ]] && { o0_run & pids+=($!); }
    [[ $runs == *" cache "* ]] && { cache_run & pids+=($!); }
    [[ $runs == *" fresh "* ]] && { fresh_run & pids+=($!); }
    [[ $runs == *" split "* ]] && { split_run & pids+=($!); }
    [[ $runs == *" exemplars "* ]] && { exemplars_run & pids+=($!); }
    wait "${pids[@]}"
    if [[ $runs == *" split "* ]] && grep -q "end split-build rc=0" "$RESULTS/status"; then
        (cd "$WORK/split" && timed split-bench scripts/gpu_run.sh bench $SAM3 precision=bf16 toolkit=machine)
        (cd "$WORK/split" && step split-parity scripts/gpu_run.sh parity $SAM3 precision=bf16 toolkit=machine)
    fi
    [[ $runs == *" bf16 "* ]] && after bf16 bf16 bench parity  # bench, then parity under bf16 autocast
    [[ $runs == *" fp32 "* ]] && after fp32 fp32 parity
    [[ $runs == *" parity "* ]] && after parity bf16 parity
    local tuned_pid=
    if [[ $runs == *" tuned "* ]] && grep -q "end tuned-tune rc=0" "$RESULTS/status"; then
        (cd "$WORK/tuned" && build tuned-build compile package verify $SAM3 precision=bf16) & tuned_pid=$!
    fi
    # the AOTI columns of the untuned builds while the tuned one compiles (CPU only: the GPU is free)
    [[ $runs == *" loader "* ]] && (cd "$WORK/loader" && build loader-bench bench $SAM3 precision=bf16)
    [[ $runs == *" fp8 "* ]] && (cd "$WORK/fp8" && build fp8-bench bench $SAM3 precision=fp8 &&
        build fp8-parity parity $SAM3 precision=fp8  # against Meta under bf16 autocast, [parity.tolerances.fp8]
        [[ -f artifacts/sam3-fp8-cuda/package/sam3.pt2 ]] && step fp8-split-overlap scripts/gpu_run.sh --python \
            experiments/split_overlap.py artifacts/sam3-fp8-cuda/package/sam3.pt2 --shapes 1x1,2x3,16x1,1x16 \
            --out "$RESULTS/split-overlap"  # every way of calling its parts in one graph
        [[ ${FP8_LEAN:-0} == 0 ]] && step fp8-vit-section scripts/gpu_run.sh --python scripts/checks/section_times.py \
            --profile sam3 --precision fp8 --device cuda --shapes 16x1 --sections ViT --kernels 16 \
            --out "$RESULTS/vit-section-fp8")  # where it goes
    local segment=segment
    if [[ $runs == *" fresh "* ]]; then
        segment=fresh && (cd "$WORK/fresh" && configure columns '["aoti_graphs"]' sections '"off"' && short_lease)
    fi
    [[ $runs == *" windowpackage "* ]] && window_package_run
    [[ $runs == *" freshbench "* ]] && (cd "$WORK/fresh" && configure columns '["meta", "aoti_graphs"]' sections '"off"' \
        load_times false && short_lease && build fresh-bench bench $SAM3 precision=bf16)
    [[ $runs == *" segment "* ]] && (cd "$WORK/$segment" && build segment-bench bench $SAM3 precision=bf16 &&
        { [[ ! -d .runtime-before ]] || step segment-load-compare scripts/gpu_run.sh --python \
            scripts/compare_load_times.py artifacts/sam3-bf16-cuda/package/sam3.pt2 .runtime-before . \
            --device cuda --out "$RESULTS/segment-load-compare"; } &&
        build segment-throughput throughput $SAM3 precision=bf16;
        ray_logs segment-throughput
        # the start-up again and again (one throughput run is one sample of it): segment over a few photographs
        [[ ${SEGMENT_STARTUP_RUNS:-5} == 0 ]] || step segment-startup scripts/gpu_run.sh --python \
            scripts/checks/segment_startup.py artifacts/sam3-bf16-cuda/package/sam3.pt2 \
            --runs "${SEGMENT_STARTUP_RUNS:-5}" --images 32 --batch-size 16 --out "$RESULTS/segment-startup.json"
        [[ ${SEGMENT_LEAN:-0} == 1 ]] || step segment-actor scripts/gpu_run.sh --python scripts/checks/segment_actor.py \
            artifacts/sam3-bf16-cuda/package/sam3.pt2 --images 64 --out "$RESULTS/segment-actor")
    [[ $runs == *" raystart "* ]] && (cd "$WORK/raystart" && step ray-start scripts/gpu_run.sh --python \
        experiments/ray_start.py --cpus 0 --gpu --repeat 3 --out "$RESULTS/ray-start")
    [[ $runs == *" ceiling "* ]] && grep -q "end ceiling-build rc=0" "$RESULTS/status" && ceiling_throughput
    [[ $runs == *" fc1 "* ]] && (cd "$WORK/fc1" && step fp8-fc1-fused scripts/gpu_run.sh --python \
        experiments/fp8_fc1_fused.py --out "$RESULTS/fp8-fc1-fused")
    [[ $runs == *" vitattn "* ]] && (cd "$WORK/vitattn" && step vit-attention scripts/gpu_run.sh --python \
        experiments/vit_attention.py --out "$RESULTS/vit-attention")
    [[ $runs == *" vitblock "* ]] && (cd "$WORK/vitblock" && step vit-block scripts/gpu_run.sh --python \
        experiments/vit_block.py --out "$RESULTS/vit-block")
    [[ $runs == *" vitnorm "* ]] && (cd "$WORK/vitnorm" && step vit-norm-fp8 scripts/gpu_run.sh --python \
        experiments/vit_norm_fp8.py --out "$RESULTS/vit-norm-fp8")
    [[ -n $tuned_pid ]] && wait "$tuned_pid" && (cd "$WORK/tuned" && build tuned-bench bench $SAM3 precision=bf16)
    [[ $runs == *" kernels "* ]] && (cd "$WORK/kernels" && fp8_kernels)
    [[ $runs == *" windoworder "* ]] && (cd "$WORK/windoworder" && window_order_run)
    [[ $runs == *" heads "* ]] && (heads_run)
    [[ $runs == *" optimizations "* ]] && (optimizations_run)
    return 0
}

pack() {
    local staging=/tmp/sam3-aoti-pack
    rm -rf "$staging" && mkdir -p "$staging"
    cp -r "$RESULTS" "$staging/logs"
    for root in "$WORK"/*/artifacts; do
        [[ -d $root ]] || continue
        local name=${root#"$WORK"/}
        name=${name%/artifacts}
        mkdir -p "$staging/${name//\//_}"
        (cd "$root" && find . -path '*/reference' -prune -o -path '*/parity/sam3.pt' -prune -o -type f \
            \( -path '*/verify/*' -o -path '*/bench/*' -o -path '*/parity/*' -o -path '*/logs/*' -o -name 'throughput.*' \
            -o -path '*/compiled/index.json' -o -path '*/compiled_parts/index.json' -o -path '*/tuning/index.json' \
            -o -name manifest.json -o -name doctor.json -o -name cuda.env -o -name program.json -o -name parts.json \) -print0 | tar --null -T - -cf -) \
            | tar -xf - -C "$staging/${name//\//_}"
        ls -l "$root"/*/package > "$staging/${name//\//_}/package-ls.txt" 2>/dev/null
        cp "${root%/artifacts}/toolkit.txt" "$staging/${name//\//_}/" 2>/dev/null
        for package in "$root"/*/package/sam3.pt2; do
            [[ -f $package ]] && (cd "${root%/artifacts}" && PYTHONPATH=/tmp/sam3-site:src python3 -m sam3_aoti info \
                "$package" > "$staging/${name//\//_}/info.txt" 2>&1)
        done
    done
    nvidia-smi > "$staging/nvidia-smi.txt" 2>&1
    tar -czf "${OUT:-/tmp}/h200-results.tar.gz" -C "$staging" .
}

case "${1:-}" in
    start)
        rm -rf "$RESULTS" && mkdir -p "$RESULTS"
        shift
        setsid nohup bash "$0" run "${@:-bf16 tiny}" > "$RESULTS/driver.log" 2>&1 < /dev/null &
        touch "$RESULTS/status"  # a `wait` right after this finds the run
        echo "started; poll with: scripts/gpu_full.sh wait 570" ;;
    run)
        shift
        run_all "$@"
        echo "$(date +%T) end all" >> "$RESULTS/status" ;;
    wait)
        [[ -f $RESULTS/status ]] || { echo "no run on this machine (a fresh one: the last was handed back)" >&2; exit 1; }
        deadline=$((SECONDS + ${2:-570}))
        while ! grep -q "end all" "$RESULTS/status" 2>/dev/null && ((SECONDS < deadline)); do sleep 5; done
        pack
        cat "$RESULTS/status"
        for log in "$RESULTS"/*.log; do echo "== $log"; tail -n 6 "$log"; done ;;
    *) echo "usage: [TOOLKIT=machine] [TUNE_LIMIT=SECS] scripts/gpu_full.sh start [sdpa] [attention] [qkvrope] [raystart] [bf16] [fp32] [parity] [tuned] [fp8] [loader] [segment] [actors] [ceiling] [fc1] [vitattn] [vitblock] [vitnorm] [tiny] [compiletime] [tinytuned] [o0] [cache] [fresh] [split] [exemplars] [windoworder] [windowpackage] [freshbench] [heads] [optimizations] | start again [ceiling] | wait SECONDS" >&2; exit 2 ;;
esac
