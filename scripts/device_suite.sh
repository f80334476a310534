#!/bin/bash
# The GPU work of the project in stages, for a device machine with no network (torch, triton and
# transformers installed; fla-core and what else it lacks carried as wheels in .whl/).
#
#   bash scripts/device_suite.sh COMMIT STAGE [STAGE ...]
#
# Stages (each writes its JSON and log under $OUT, default ./device_out):
#   gpu-tests   every test marked gpu except the families' engine tests (pytest, 240 s a test);
#               GPU_TESTS='file ...' limits it to those files
#   families    the families' engine tests alone, one pytest each (fla's KDA autotuning alone has
#               taken > 200 s); FAMILIES='kimi_linear olmo_hybrid' picks, FAMILIES_TIMEOUT (500 s) bounds
#   bench       benchmarks/gpu_bench.py (one GPU)
#   moe         benchmarks/moe_bench.py: the Qwen3.5-35B-A3B shape, ours against transformers + fla in
#               turn (one GPU, ~6 min on an H100); MOE_BENCH_ARGS adds flags (--layers, --quick, --sections)
#   served-gpu  benchmarks/served_gpu.py: router, cache tier, combine and scatter started by
#               `hybridcache up --device cuda`, driven over HTTP against an in-process engine (one
#               GPU); SERVED_GPU_PHASES picks the phases (default all: inproc,pic,scatter,scatter_ipc,prefix),
#               SERVED_GPU_ARGS adds flags (--layers 0: all the preset's layers),
#               SERVED_GPU_MERGE names an earlier result whose other phases count in the figures
#   qps         benchmarks/qps.py --trace-requests 24 (one GPU)
#   profile     tools/profile_forward.py --segments 32 --sync-check (one GPU)
#   profile-decode  tools/profile_decode.py: a decode step's kernels, launches and host time, eager
#               and graphed; PROFILE_DECODE_ARGS (default: the MoE shape, 16 layers, batches 1 and 32)
#   fold        tools/fold_bench.py: one linear layer's fold of a 32 x 1k pic request (one GPU)
#   profile-engine  tools/profile_engine.py: the 9B shape's warm 32 x 1k + 64 pic request through the
#               scheduler, timed and profiled with the engine's stages marked; PROFILE_ENGINE_ARGS
#               adds flags (--arch qwen3_5_moe_text --preset qwen3.5-35b-a3b --layers 8: the MoE shape)
#   chunks      tools/profile_chunks.py: a long plain prompt prefilled a budget at a time, each chunk
#               timed with and without the prefix cache's recording, one deep chunk profiled;
#               CHUNKS_ARGS adds flags (default --tokens 32768 --budget 512 --modes full,pic)
#   mixed       tools/profile_mixed.py: the combine worker's scheduler stepped in one process, 32 streams
#               decoding while a 128k-token cold prompt prefills (budget 128, 16 layer parts), each
#               step timed by what it ran of the prompt's chunk; MIXED_ARGS replaces its flags
#   train       benchmarks/train_qa_model.py --fla (the QA model of issue 7) for TRAIN_SECONDS (default
#               500), continuing from .qa-ckpt/ when it holds a model (carry it); TRAIN_ARGS adds
#               flags. The model comes back sharded in $OUT/model; to chain calls, here:
#               python benchmarks/train_qa_model.py --install-from <that folder> --out .qa-ckpt
#   transport   the scatter -> combine transport between two processes on one GPU: benchmarks/transport_loopback.py
#               --cuda-ipc (LOOPBACK_ENTRIES entries a request, default 32, five requests), the receiver's host
#               work alone (benchmarks/assembler_host.py, on this machine's CPU) and the transport's gpu tests
#               (tests/services/test_ipc_pool_gpu.py, tests/kernels/test_copy_checksum.py)
#   decode      issue 43 on one GPU: the decode step's kernels against their references (recurrence,
#               sampler, paged attention with its fused query rope and gate, keys into pages, norms;
#               gpu tests included) and graphed decode against eager and the live pass, then benchmarks/served_decode.py (1, 32, 128 greedy streams, 32 sampled, on
#               the Qwen3.5-9B shape written once to $SERVED_MODEL); DECODE_ARGS adds its flags
#   layouts     issue 44 on one GPU: the planned assemblies' and paged prefill's gpu tests
#               (tests/kernels/test_assembly_graphs_gpu.py, test_paged_prefill_attention.py, test_cuda_graphs.py),
#               then benchmarks/served_pic_layouts.py (warm pic of unseen vs repeated layouts, 32 x 1k
#               against its floor) on the Qwen3.5-9B shape written once to $SERVED_MODEL; LAYOUTS_ARGS adds flags
#   long        benchmarks/served_long_prompt.py on that model: LONG_PHASES (default itl) of itl, pic,
#               prefix, full, merged into $OUT/served_long_prompt.json with a carried long.json when
#               there (one or two phases a call keep it inside 10 minutes); LONG_ARGS adds flags
#   itl-sweep   the long stage's itl phase once for each BUDGET:PARTS of ITL_SWEEP (default "256:4 256:8
#               128:16": --itl-budget and --itl-layer-parts), a result file each, ITL_SWEEP_TIMEOUT (200 s) a run
#               (the model written first, outside those timeouts)
#   served      benchmarks/served_load.py through `hybridcache up --device cuda` on the Qwen3.5-9B
#               shape (random bf16 weights, written once to $SERVED_MODEL, default /tmp/served-q9b):
#               SERVED_SCENARIO=streams (default: 32 streams of 256 tokens vs 1) or rag (the RAG
#               sweep, Poisson arrivals, of SERVED_MODES, default pic: one mode a call keeps a call
#               inside 10 minutes); SERVED_ARGS adds flags, SERVED_UP_ARGS `hybridcache up` flags. Merge the calls' JSONs with
#               python benchmarks/served_load.py --combine A.json B.json ... --out FILE
#   multiturn   benchmarks/multiturn.py on the Qwen3.5-9B shape (the model written first, in its own
#               process, to $SERVED_MODEL): checkpoint, exact_replay, suffix_replay (fp8 anchors), SGLang's
#               peer (the checkpoint policy on its 8,192-token grid with every finished request's end
#               state) and that grid alone, one `hybridcache up --mode prefix` each at one page-tree
#               budget, in that order (each policy's result is written as it ends: a run cut short keeps
#               the ones before); MULTITURN_ARGS adds flags (--policies suffix_replay,sglang_peer,sglang_grid:
#               the figure's three alone), MULTITURN_UP_ARGS `hybridcache up` flags (graphs on by default)
# Timing stages should run alone on the machine: CPU-heavy neighbours slow launch-bound work.
#
# Triton's cache (compiled kernels and, with fla's cache_results, its autotuning results) is
# restored from .triton-cache/triton_cache.tgz (or its parts triton_cache.tgz.aa, .ab, ...) when
# there, and saved to $OUT at the end: as triton_cache.tgz when under 16 MiB (the limit on a file
# brought back), else split into 15 MiB parts (a file brought back each, 8 at most in all; 37 MB
# after the KDA tests' compilation). Copy what comes back into .triton-cache/ (git-ignored) and
# carry that folder: later calls skip the compilation and autotuning that kept fla's KDA tests
# from finishing inside a call. TRITON_CACHE_SAVE=0 saves nothing (a call that needs its file
# slots for other results).
set -u
if [ $# -lt 2 ]; then
    echo "usage: bash scripts/device_suite.sh COMMIT STAGE [STAGE ...]" >&2
    exit 2
fi
commit=$1
shift
for stage in "$@"; do
    case $stage in
    gpu-tests | families | bench | moe | served-gpu | qps | profile | profile-decode | profile-engine | chunks | fold | train \
        | transport | decode | layouts | long | itl-sweep | mixed \
        | served | multiturn) ;;
    *)
        echo "device_suite: unknown stage $stage (gpu-tests, families, bench, moe, served-gpu, qps, profile, profile-decode, profile-engine, chunks, mixed, fold, train, transport, decode, layouts, long, itl-sweep, served, multiturn)" >&2
        exit 2 ;;
    esac
    if [ "$stage" = itl-sweep ]; then
        for pair in ${ITL_SWEEP:-256:4 256:8 128:16}; do
            if ! [[ $pair =~ ^[1-9][0-9]*:[1-9][0-9]*$ ]]; then
                echo "device_suite: ITL_SWEEP entries are BUDGET:PARTS (e.g. 256:8), got '$pair'" >&2
                exit 2
            fi
        done
    fi
done
OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device_suite: installing .whl/ failed" >&2; exit 2; }
fi
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/hybridcache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .triton-cache/triton_cache.tgz ]; then
    tar -xzf .triton-cache/triton_cache.tgz -C "$TRITON_CACHE_DIR" && echo "device_suite: Triton cache restored ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
elif ls .triton-cache/triton_cache.tgz.?? > /dev/null 2>&1; then
    cat .triton-cache/triton_cache.tgz.?? | tar -xz -C "$TRITON_CACHE_DIR" \
        && echo "device_suite: Triton cache restored from $(ls .triton-cache/triton_cache.tgz.?? | wc -l) parts ($(du -sh "$TRITON_CACHE_DIR" | cut -f1))"
fi
save_triton_cache() {
    [ "${TRITON_CACHE_SAVE:-1}" = 0 ] && return
    tar -czf /tmp/triton_cache.tgz -C "$TRITON_CACHE_DIR" . 2> /dev/null || return
    local size
    size=$(stat -c %s /tmp/triton_cache.tgz)
    if [ "$size" -lt $((16 * 1024 * 1024)) ]; then
        cp /tmp/triton_cache.tgz "$OUT/triton_cache.tgz"
    elif [ "$size" -le $((5 * 15 * 1024 * 1024)) ]; then
        split -b 15M -a 2 /tmp/triton_cache.tgz "$OUT/triton_cache.tgz."
        echo "device_suite: Triton cache is $(du -h /tmp/triton_cache.tgz | cut -f1): saved in $(ls "$OUT"/triton_cache.tgz.?? | wc -l) parts" >&2
    else
        echo "device_suite: Triton cache is $(du -h /tmp/triton_cache.tgz | cut -f1), over the five 15 MiB parts it may take of the files brought back; not saved" >&2
    fi
}
trap save_triton_cache EXIT
trap "exit 143" TERM INT
export PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 HYBRIDCACHE_COMMIT=$commit
python3 -c "import fla" 2> /dev/null || echo "device_suite: warning: fla-core is not importable (put its wheel in .whl/)" >&2
# the Qwen3.5-9B shape's random bf16 model written to $1 unless there, by a process of its own (a
# writer that stays alive keeps its GPU memory from the server)
write_served_model() {
    [ -f "$1/config.json" ] && return 0
    python3 -P -c "import sys, torch; from hybridcache.services.runtime.modelzoo import init_model_dir; \
init_model_dir('qwen3_5_text', 'qwen3.5-9b', sys.argv[1], seed=0, dtype=torch.bfloat16, device='cuda')" "$1"
}
families="tests/kernels/test_families_gpu.py::test_tiny_model_cuda_fp32_matches_cpu_and_pic_is_consistent"
for stage in "$@"; do
    case $stage in
    gpu-tests)
        # only the files that hold gpu tests: the device machine lacks the serving stack's packages
        # (the families' file last: fla's KDA kernels autotune for minutes)
        gpu_files=$(grep -rl --include='test_*.py' -e 'mark\.gpu' tests | sort | grep -v test_families_gpu.py)
        gpu_files="$gpu_files tests/kernels/test_families_gpu.py"
        gpu_files=${GPU_TESTS:-$gpu_files}  # GPU_TESTS='file ...' runs those files only
        TRITON_F32_DEFAULT=ieee python3 -P -m pytest -v -m gpu -p no:cacheprovider -rfE --timeout 240 $gpu_files \
            --deselect "$families" > "$OUT/gpu_tests.log" 2>&1
        echo "gpu-tests rc=$?"; grep -E "passed|failed" "$OUT/gpu_tests.log" | tail -3 ;;
    families)
        # one pytest per family, each under its own limit (FAMILIES_TIMEOUT, default 500 s, split
        # evenly), so a family that compiles past it still leaves the failures of the others in
        # the log and the Triton cache saved; FAMILIES picks the families (default: all five)
        fams=${FAMILIES:-kimi_linear nemotron_h bamba minimax olmo_hybrid}
        per=$(( ${FAMILIES_TIMEOUT:-500} / $(echo $fams | wc -w) ))
        : > "$OUT/families.log"
        for fam in $fams; do
            TRITON_F32_DEFAULT=ieee timeout -s INT "$per" python3 -P -m pytest -v -s -m gpu -p no:cacheprovider -rfE \
                --tb=short "$families[$fam]" >> "$OUT/families.log" 2>&1
            echo "families $fam rc=$? (limit $per s)"
        done
        grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/families.log" | tail -12 ;;
    bench)
        python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" > "$OUT/gpu_bench.log" 2>&1
        echo "bench rc=$?" ;;
    moe)
        # shellcheck disable=SC2086  # MOE_BENCH_ARGS is a list of flags
        python3 benchmarks/moe_bench.py ${MOE_BENCH_ARGS:-} --out "$OUT/moe_bench.json" > "$OUT/moe_bench.log" 2>&1
        echo "moe rc=$?"; grep -E "moe_bench: " "$OUT/moe_bench.log" | cut -c1-300 ;;
    served-gpu)
        merge=()
        [ -n "${SERVED_GPU_MERGE:-}" ] && merge=(--merge "$SERVED_GPU_MERGE")
        # shellcheck disable=SC2086  # SERVED_GPU_ARGS is a list of flags
        python3 benchmarks/served_gpu.py --phases "${SERVED_GPU_PHASES:-inproc,pic,scatter,scatter_ipc,prefix}" "${merge[@]}" \
            ${SERVED_GPU_ARGS:-} \
            --out "$OUT/served_gpu.json" > "$OUT/served_gpu.log" 2>&1
        echo "served-gpu rc=$?"; grep -E "served_gpu: .* done" "$OUT/served_gpu.log" ;;
    qps)
        python3 benchmarks/qps.py --trace-requests 24 --out "$OUT/qps.json" > "$OUT/qps.log" 2>&1
        echo "qps rc=$?" ;;
    profile)
        python3 tools/profile_forward.py --segments 32 --top 25 --sync-check > "$OUT/profile.json" 2> "$OUT/profile.log"
        echo "profile rc=$?" ;;
    profile-decode)
        python3 tools/profile_decode.py \
            ${PROFILE_DECODE_ARGS:---preset qwen3.5-35b-a3b --layers 16 --batches 1,32} \
            > "$OUT/profile_decode.json" 2> "$OUT/profile_decode.log"
        echo "profile-decode rc=$?"; tail -4 "$OUT/profile_decode.log" ;;
    profile-engine)
        # shellcheck disable=SC2086  # PROFILE_ENGINE_ARGS is a list of flags
        python3 tools/profile_engine.py ${PROFILE_ENGINE_ARGS:-} > "$OUT/profile_engine.json" 2> "$OUT/profile_engine.log"
        echo "profile-engine rc=$?"; tail -2 "$OUT/profile_engine.log" ;;
    chunks)
        # shellcheck disable=SC2086  # CHUNKS_ARGS is a list of flags
        python3 tools/profile_chunks.py ${CHUNKS_ARGS:---tokens 32768 --budget 512 --modes full,pic} \
            > "$OUT/profile_chunks.json" 2> "$OUT/profile_chunks.log"
        echo "chunks rc=$?"; tail -2 "$OUT/profile_chunks.log" ;;
    mixed)
        # shellcheck disable=SC2086  # MIXED_ARGS is a list of flags
        python3 tools/profile_mixed.py ${MIXED_ARGS:---streams 32 --long-tokens 131072 --budget 128 --layer-parts 16} \
            > "$OUT/profile_mixed.json" 2> "$OUT/profile_mixed.log"
        echo "mixed rc=$?"; tail -2 "$OUT/profile_mixed.log"
        grep -A7 -E '"(steady_gap_ms|during_gap_ms)"' "$OUT/profile_mixed.json" | grep -E 'gap|p50|p99' ;;
    fold)
        python3 tools/fold_bench.py --out "$OUT/fold.json" > "$OUT/fold.log" 2>&1
        echo "fold rc=$?" ;;
    train)
        init=()
        if [ -f .qa-ckpt/model.safetensors ]; then
            init=(--init-from .qa-ckpt --warmup 20)
        fi
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list of flags
        python3 benchmarks/train_qa_model.py --fla --out /tmp/qa --export "$OUT/model" --time-budget "${TRAIN_SECONDS:-500}" \
            --workers 12 --save-every 120 "${init[@]}" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
        echo "train rc=$? (init: ${init[*]:-none})"; grep -E '"val_acc_1hop"' "$OUT/train.log" | tail -3 ;;
    transport)
        timeout 240 python3 benchmarks/transport_loopback.py --cuda-ipc --entries "${LOOPBACK_ENTRIES:-32}" --requests 5 \
            --out "$OUT/transport_loopback.json" > "$OUT/transport_loopback.log" 2>&1
        echo "transport loopback rc=$?"; grep -o '"figures": {[^}]*}' "$OUT/transport_loopback.json" | cut -c1-600
        timeout 120 python3 benchmarks/assembler_host.py --out "$OUT/assembler_host.json" > "$OUT/assembler_host.log" 2>&1
        echo "transport assembler_host rc=$?"; grep -E '"host_(ms_per_request|us_per_tensor)"' "$OUT/assembler_host.json"
        TRITON_F32_DEFAULT=ieee timeout 240 python3 -P -m pytest -v -s -m gpu -p no:cacheprovider -rfE \
            tests/services/test_ipc_pool_gpu.py tests/kernels/test_copy_checksum.py > "$OUT/transport_tests.log" 2>&1
        echo "transport gpu tests rc=$?"; grep -E "cuda_ipc arena|passed|failed" "$OUT/transport_tests.log" | cut -c1-300 | tail -6 ;;
    decode)
        # DECODE_KERNEL_TESTS=0 leaves the kernel tests out (a call that re-measures the benchmark only)
        [ "${DECODE_KERNEL_TESTS:-1}" = 0 ] || timeout 300 python3 -P -m pytest -v -s -m "gpu or not gpu" -p no:cacheprovider -rfE \
            tests/kernels/test_recurrent_step.py tests/kernels/test_sampling_kernel.py tests/kernels/test_paged_attention_kernel.py \
            tests/kernels/test_rope_triton.py tests/kernels/test_row_norm.py tests/kernels/test_decode_graphs_gpu.py \
            > "$OUT/decode_kernels.log" 2>&1
        echo "decode kernels rc=$?"; grep -E "kernel .* ms|passed|failed" "$OUT/decode_kernels.log" | tail -5
        # shellcheck disable=SC2086  # DECODE_ARGS is a list of flags
        timeout 540 python3 benchmarks/served_decode.py --device cuda --init-model qwen3_5_text:qwen3.5-9b \
            --model "${SERVED_MODEL:-/tmp/served-q9b}" ${DECODE_ARGS:-} --out "$OUT/served_decode.json" \
            > "$OUT/served_decode.log" 2>&1
        echo "decode served rc=$?"; grep -o '"figures": {[^}]*}' "$OUT/served_decode.json" ;;
    layouts)
        TRITON_F32_DEFAULT=ieee timeout 300 python3 -P -m pytest -v -s -m gpu -p no:cacheprovider -rfE \
            tests/kernels/test_assembly_graphs_gpu.py tests/kernels/test_paged_prefill_attention.py \
            tests/kernels/test_cuda_graphs.py > "$OUT/layouts_tests.log" 2>&1
        echo "layouts gpu tests rc=$?"; grep -E "passed|failed" "$OUT/layouts_tests.log" | tail -3
        # shellcheck disable=SC2086  # LAYOUTS_ARGS is a list of flags
        timeout 480 python3 benchmarks/served_pic_layouts.py --device cuda --init-model qwen3_5_text:qwen3.5-9b \
            --model "${SERVED_MODEL:-/tmp/served-q9b}" ${LAYOUTS_ARGS:-} --out "$OUT/served_pic_layouts.json" \
            > "$OUT/served_pic_layouts.log" 2>&1
        echo "layouts served rc=$?"; grep -o '"figures": {[^}]*}' "$OUT/served_pic_layouts.json" ;;
    long)
        merge=()
        if [ -f long.json ]; then cp long.json "$OUT/served_long_prompt.json"; merge=(--merge); fi
        # shellcheck disable=SC2086  # LONG_ARGS is a list of flags
        timeout 560 python3 benchmarks/served_long_prompt.py --device cuda --init-model qwen3_5_text:qwen3.5-9b \
            --model "${SERVED_MODEL:-/tmp/served-q9b}" --phases "${LONG_PHASES:-itl}" "${merge[@]}" ${LONG_ARGS:-} \
            --out "$OUT/served_long_prompt.json" > "$OUT/served_long_prompt.log" 2>&1
        echo "long rc=$?"; grep -o '"figures": {[^}]*}' "$OUT/served_long_prompt.json" ;;
    itl-sweep)
        # the itl phase once for each BUDGET:PARTS of ITL_SWEEP, a result file each; the model is
        # written first, in a process of its own, so that each run's ITL_SWEEP_TIMEOUT is the run's
        model=${SERVED_MODEL:-/tmp/served-q9b}
        write_served_model "$model" || echo "itl-sweep: writing the model failed (each run writes it then)" >&2
        for pair in ${ITL_SWEEP:-256:4 256:8 128:16}; do
            b=${pair%%:*} p=${pair##*:}
            timeout "${ITL_SWEEP_TIMEOUT:-200}" python3 benchmarks/served_long_prompt.py --device cuda \
                --init-model qwen3_5_text:qwen3.5-9b --model "$model" --phases itl \
                --itl-budget "$b" --itl-layer-parts "$p" --out "$OUT/served_long_prompt_itl_b${b}_p${p}.json" \
                > "$OUT/served_long_prompt_itl_b${b}_p${p}.log" 2>&1
            echo "itl-sweep budget $b parts $p rc=$?"
            grep -o '"figures": {[^}]*}' "$OUT/served_long_prompt_itl_b${b}_p${p}.json" 2> /dev/null
        done ;;
    served)
        scenario=${SERVED_SCENARIO:-streams}
        modes=${SERVED_MODES:-pic}
        up="--scatter-workers 0 --max-num-seqs 32 --ready-timeout-s 600 ${SERVED_UP_ARGS:-}"
        if [ "$scenario" = streams ]; then
            args=(--scenario streams --streams 1,32 --requests-per-stream 2 --max-tokens 256 --prompt-tokens 64
                  --repeats 2)
            name=streams
        else
            args=(--scenario rag --modes "$modes" --rates 0.5,1,2,4,8,16 --rag-requests 12 --warmup-requests 4
                  --docs 64 --doc-tokens 1024 --docs-per-request 4,32 --question-tokens 64 --rag-max-tokens 16
                  --slo-ttft-s 1.0)
            name=rag_${modes//,/_}
        fi
        # shellcheck disable=SC2086  # SERVED_ARGS is a list of flags
        python3 benchmarks/served_load.py --device cuda --dtype bfloat16 --init-model qwen3_5_text:qwen3.5-9b \
            --model "${SERVED_MODEL:-/tmp/served-q9b}" --up-args "$up" "${args[@]}" ${SERVED_ARGS:-} \
            --out "$OUT/served_$name.json" > "$OUT/served_$name.log" 2>&1
        echo "served $name rc=$?"; grep -E "served_load:" "$OUT/served_$name.log" | cut -c1-240 | tail -8 ;;
    multiturn)
        model=${SERVED_MODEL:-/tmp/served-q9b}
        write_served_model "$model" || { echo "multiturn: writing the model failed" >&2; continue; }
        # CUDA graphs as served by default (decode steps, suffix_replay's restores);
        # MULTITURN_UP_ARGS="--cuda-graphs off --decode-cuda-graphs off" runs every server eagerly
        up="--scatter-workers 0 --max-num-seqs 32 --ready-timeout-s 300 --warmup-shape none ${MULTITURN_UP_ARGS:-}"
        # shellcheck disable=SC2086  # MULTITURN_ARGS is a list of flags
        timeout 540 python3 benchmarks/multiturn.py --device cuda --dtype bfloat16 --model "$model" --up-args "$up" \
            --conversations 24 --rate 2 --systems 4 --system-tokens 2048 --user-tokens 64,256 --output-tokens 32 \
            --vocab 150000 ${MULTITURN_ARGS:-} --out "$OUT/multiturn.json" > "$OUT/multiturn.log" 2>&1
        echo "multiturn rc=$?"; grep -E "multiturn:" "$OUT/multiturn.log" | cut -c1-240 | tail -6
        grep -o '"figures": {[^}]*}' "$OUT/multiturn.json" | cut -c1-900 ;;
    esac
done
