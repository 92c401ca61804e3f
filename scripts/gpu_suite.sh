#!/usr/bin/env bash
# The whole GPU side of dcpkit in one call on a multi-GPU machine: environment facts,
# `python -m dcpkit info`, the GPU tests (single process, then `mpirun -np N` for each world
# size), the demo and the benchmark. Everything lands under $OUT (default ./out):
#
#   summary.txt       one line per stage (name, world size, exit status, seconds) + env facts
#   logs.tar.gz       every stage's log, per-rank logs of the mpirun stages, and every result
#                     file below (results/ inside it), also those left out of $OUT
#   bench_N.json      `dcpkit bench --json` for each world size N (BENCHMARKS.md is made from these)
#   bench_base_N.json the same from the baseline checkout (DCPKIT_SUITE_BASELINE)
#   demo_N.json       `dcpkit demo --json` for each N
#   bench_N.png       the bench plots (where matplotlib is installed: the `bench` extra)
# At most DCPKIT_SUITE_MAX_FILES files (default 8) land in $OUT, in the order above, so that
# $OUT stays a short list to read and to copy off the machine; logs.tar.gz holds every result.
#
# Settings (environment):
#   DCPKIT_SUITE_STAGES   comma list of info,tests,demo,bench        (default: all four), no
#                         spaces, no empty names
#   DCPKIT_SUITE_NP       world sizes, e.g. "2" or "2 4"              (default "2 4"; sizes above
#                         the number of GPUs are dropped: no oversubscribed runs); every list of
#                         world sizes holds distinct whole numbers from 1 to 1024
#   DCPKIT_SUITE_SHARED_GPU  0 (default) or 1: also run world sizes above the number of GPUs,
#                         ranks sharing GPUs (without MPS their kernels time-slice the GPU:
#                         functional checks only; with DCPKIT_SUITE_MPS=1 they run side by side)
#   DCPKIT_SUITE_DEMO_NP, DCPKIT_SUITE_BENCH_NP  world sizes of the demo / bench stages
#                         (default: those of DCPKIT_SUITE_NP)
#   stages "overhead" (scripts/host_overhead.py, N = DCPKIT_SUITE_OVERHEAD_NP, default 2),
#   "programmatic" (scripts/programmatic_launch.py, N = DCPKIT_SUITE_PROGRAMMATIC_NP, default 2,
#   with the bench stages' MPS share; programmatic_N.json), "probe" (scripts/protocol_probe.py,
#   N = DCPKIT_SUITE_PROBE_NP, default 2, with the bench stages' MPS share; probe_N.json) and
#   "soak" (scripts/soak.py, N =
#   DCPKIT_SUITE_SOAK_NP, default 4, DCPKIT_SUITE_SOAK_CALLS calls, default 100000) run only
#   when named in DCPKIT_SUITE_STAGES
#   DCPKIT_SUITE_MPS      0 (default) or 1: with shared GPUs, run an MPS daemon of this
#                         machine's own (see below); the bench stages then give every rank
#                         CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100/N (dcpkit and NVSHMEM alike;
#                         NVSHMEM's on-stream collectives abort without it), unless that
#                         variable is already set
#   DCPKIT_SUITE_BASELINE a folder holding another checkout of dcpkit (an older commit): right
#                         before each bench stage, `dcpkit bench --quick` runs from it at the
#                         same world size (bench_base_N.json), so one call gives before/after;
#                         DCPKIT_SUITE_BASELINE_COMMIT (a hash of 4 to 64 hex digits) names
#                         its commit where it is not a git checkout (default: its git HEAD, else
#                         "unknown"); the folder must exist and hold dcpkit/__init__.py
#   DCPKIT_SUITE_BUDGET_S seconds the whole script may take           (default 570); each stage is
#                         bounded by what is left of it, and skipped when too little is left;
#                         at least 60 (40 s are kept for the summary, and a stage needs 20 s)
#   DCPKIT_SUITE_MAX_FILES  the most files in $OUT, summary.txt and logs.tar.gz included
#                         (default 8, 2 to 1000)
#   DCPKIT_BENCH_ARGS     extra arguments of `dcpkit bench`, e.g. "--quick"
#   DCPKIT_PYTEST_ARGS    extra arguments of the pytest runs, e.g. "-k lse"
#   DCPKIT_SUITE_MPI_XFLAG  pytest's -x for the mpi tests: "-x" (default: stop at the first
#                         failure) or "" (run them all)
#   DCPKIT_SUITE_TEST_TIMEOUT_S  per-test timeout of the mpi tests in seconds (default 300)
#   DCPKIT_SUITE_MPI_CAP_S, DCPKIT_SUITE_SOAK_CAP_S  seconds each mpitests / soak stage may take
#                         (default 400 / 240; at least 20)
#   stages "mpitests" and "gputests" select one half of "tests"
#   PYTHON                the interpreter (default python3)
# Every DCPKIT_SUITE_* variable is checked at the start, before anything is started, installed
# or written: a value other than the above, or a name that is no setting, is one line naming the
# variable and its value, and exit status 2. An empty value means the default (except
# DCPKIT_SUITE_MPI_XFLAG="", no -x); whole numbers are ASCII digits without a leading zero.
#
# Never touches NCCL_NVLS_ENABLE, NVSHMEM_DISABLE_NVLS, TORCH_SYMM_MEM_DISABLE_MULTICAST or
# DCPKIT_DISABLE_MULTICAST: they are printed at the start and checked unchanged before every
# stage (README.md, "Known limits"; NOTE [dcpkit multicast guard] in dcpkit/multicast.py).
#
# Exit status: 0 when every stage passed; 2 on a bad setting (before anything runs), or on a
# machine with no GPU (after the info stage: the other stages need GPUs and would otherwise be
# dropped silently); 3 when a multicast variable changed; otherwise 1 when a stage failed or a
# requested stage had no world size to run at.
#
# Run from the repository root:  bash scripts/gpu_suite.sh      (bash scripts/gpu_suite.sh --help)
set -u
set -o pipefail

usage() {  # the comment block at the top of this file
    sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
case "${1-}" in
    -h|--help) usage; exit 0 ;;
    "") ;;
    *) echo "gpu_suite.sh: unknown argument '$1' (settings are environment variables; see" \
            "bash scripts/gpu_suite.sh --help)" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$ROOT/out}"
PY="${PYTHON:-python3}"

# ----------------------------------------------------------------------------- settings
# Every DCPKIT_SUITE_* setting is checked here, before anything is started, installed or
# written: a bad value (or a name that is no setting) is one line on stderr naming the variable
# and its value, exit status 2. An empty value means the default, except for
# DCPKIT_SUITE_MPI_XFLAG, where "" means no -x. Whole numbers are ASCII digits without a leading
# zero (bash would read 010 as octal) and at most 9 digits (no 64-bit overflow in $(( ))).
SETTINGS="DCPKIT_SUITE_STAGES DCPKIT_SUITE_NP DCPKIT_SUITE_SHARED_GPU DCPKIT_SUITE_DEMO_NP
DCPKIT_SUITE_BENCH_NP DCPKIT_SUITE_OVERHEAD_NP DCPKIT_SUITE_PROGRAMMATIC_NP DCPKIT_SUITE_PROBE_NP
DCPKIT_SUITE_SOAK_NP DCPKIT_SUITE_SOAK_CALLS DCPKIT_SUITE_SOAK_CAP_S DCPKIT_SUITE_MPS DCPKIT_SUITE_BASELINE
DCPKIT_SUITE_BASELINE_COMMIT DCPKIT_SUITE_BUDGET_S DCPKIT_SUITE_MAX_FILES DCPKIT_SUITE_MPI_XFLAG
DCPKIT_SUITE_MPI_CAP_S DCPKIT_SUITE_TEST_TIMEOUT_S"
SETTINGS="${SETTINGS//$'\n'/ }"
KNOWN_STAGES="info tests mpitests gputests overhead programmatic probe soak demo bench"

bad_setting() {  # bad_setting VAR RULE...: "VAR must RULE (got 'value')" on stderr, exit 2
    local var=$1
    shift
    echo "gpu_suite.sh: $var must $* (got '${!var}')" >&2
    exit 2
}
check_bool() {  # check_bool VAR: 0 or 1 where set
    case "${!1-}" in "" | 0 | 1) ;; *) bad_setting "$1" "be 0 or 1" ;; esac
}
check_whole() {  # check_whole VAR MIN MAX WHAT [WHY]: a whole number in [MIN, MAX] where set
    local v="${!1-}"
    [ -z "$v" ] && return 0
    if ! [[ "$v" =~ ^(0|[123456789][0123456789]{0,8})$ ]] || [ "$v" -lt "$2" ] ||
            [ "$v" -gt "$3" ]; then
        bad_setting "$1" "be $4 in [$2, $3], in ASCII digits without a leading zero${5:+ ($5)}"
    fi
}
check_sizes() {  # check_sizes VAR: world sizes, distinct whole numbers in [1, 1024], where set
    local v="${!1-}" n seen=" " rule
    [ -z "$v" ] && return 0
    rule="be world sizes, distinct whole numbers in [1, 1024] separated by spaces, e.g. \"2 4\""
    [[ "$v" =~ ^[0123456789\ ]*[0123456789][0123456789\ ]*$ ]] || bad_setting "$1" "$rule"
    for n in $v; do   # digits and spaces only: no glob, no other separator
        if ! [[ "$n" =~ ^[123456789][0123456789]{0,3}$ ]] || [ "$n" -gt 1024 ] ||
                [[ "$seen" == *" $n "* ]]; then
            bad_setting "$1" "$rule"
        fi
        seen="$seen$n "
    done
}

for var in ${!DCPKIT_SUITE_@}; do  # every DCPKIT_SUITE_* variable set: each a known setting
    if [[ " $SETTINGS " != *" $var "* ]]; then
        echo "gpu_suite.sh: $var is not a setting of this script (got '${!var}'); the settings" \
             "are ${SETTINGS// /, } (bash scripts/gpu_suite.sh --help)" >&2
        exit 2
    fi
done
if [ -n "${DCPKIT_SUITE_STAGES-}" ]; then
    _stages_ok=0
    if [[ "$DCPKIT_SUITE_STAGES" =~ ^[a-z]+(,[a-z]+)*$ ]]; then
        _stages_ok=1
        _seen=" "
        for st in ${DCPKIT_SUITE_STAGES//,/ }; do
            [[ " $KNOWN_STAGES " == *" $st "* && "$_seen" != *" $st "* ]] || _stages_ok=0
            _seen="$_seen$st "
        done
    fi
    [ "$_stages_ok" = 1 ] || bad_setting DCPKIT_SUITE_STAGES \
        "be a comma list of distinct names of ${KNOWN_STAGES// /, }, without spaces or empty names"
fi
for var in DCPKIT_SUITE_NP DCPKIT_SUITE_DEMO_NP DCPKIT_SUITE_BENCH_NP DCPKIT_SUITE_OVERHEAD_NP \
           DCPKIT_SUITE_PROGRAMMATIC_NP DCPKIT_SUITE_PROBE_NP DCPKIT_SUITE_SOAK_NP; do
    check_sizes "$var"
done
check_bool DCPKIT_SUITE_SHARED_GPU
check_bool DCPKIT_SUITE_MPS
check_whole DCPKIT_SUITE_BUDGET_S 60 86400 "a whole number of seconds" \
    "40 s are kept for the summary, and a stage needs 20 s"
check_whole DCPKIT_SUITE_MAX_FILES 2 1000 "a whole number" "summary.txt and logs.tar.gz count"
check_whole DCPKIT_SUITE_MPI_CAP_S 20 86400 "a whole number of seconds" \
    "a stage limited below 20 s is skipped"
check_whole DCPKIT_SUITE_SOAK_CAP_S 20 86400 "a whole number of seconds" \
    "a stage limited below 20 s is skipped"
check_whole DCPKIT_SUITE_TEST_TIMEOUT_S 1 86400 "a whole number of seconds"
check_whole DCPKIT_SUITE_SOAK_CALLS 1 1000000000 "a whole number of calls"
case "${DCPKIT_SUITE_MPI_XFLAG--x}" in
    -x | "") ;;
    *) bad_setting DCPKIT_SUITE_MPI_XFLAG "be -x (stop the mpi tests at the first failure, the" \
           "default) or empty (run them all)" ;;
esac
if [ -n "${DCPKIT_SUITE_BASELINE-}" ]; then
    if [ ! -d "$DCPKIT_SUITE_BASELINE" ]; then
        bad_setting DCPKIT_SUITE_BASELINE "be a folder holding another checkout of dcpkit; there" \
            "is no such folder"
    elif [ ! -f "$DCPKIT_SUITE_BASELINE/dcpkit/__init__.py" ]; then
        bad_setting DCPKIT_SUITE_BASELINE "be a folder holding another checkout of dcpkit; this" \
            "one holds no dcpkit/__init__.py"
    fi
fi
if [ -n "${DCPKIT_SUITE_BASELINE_COMMIT-}" ] &&
        ! [[ "$DCPKIT_SUITE_BASELINE_COMMIT" =~ ^[0123456789abcdefABCDEF]{4,64}$ ]]; then
    bad_setting DCPKIT_SUITE_BASELINE_COMMIT "be a commit hash, 4 to 64 hex digits"
fi
STAGES=",${DCPKIT_SUITE_STAGES:-info,tests,demo,bench},"
BUDGET_S="${DCPKIT_SUITE_BUDGET_S:-570}"
MAX_FILES="${DCPKIT_SUITE_MAX_FILES:-8}"
if [[ $STAGES == *,bench,* ]]; then
    # the options the bench stage sets itself, or that would make it run no benchmark
    # shellcheck disable=SC2086
    for a in ${DCPKIT_BENCH_ARGS:-}; do
        case "$a" in
            --json | --json=* | --plot | --plot=* | --render-md | --render-md=* | --md-out | \
            --md-out=* | --baseline | --baseline=* | --notes | --notes=* | --host-overhead | \
            --host-overhead=* | --check-args | --help | -h)
                bad_setting DCPKIT_BENCH_ARGS "be options of a benchmark run: the suite sets" \
                    "--json and --plot itself, and '${a%%=*}' runs no benchmark or replaces" \
                    "its output" ;;
        esac
    done
    CHECK_DIR="${TMPDIR:-/tmp}"
    [ -d "$CHECK_DIR" ] || CHECK_DIR=/tmp  # a bad TMPDIR is not the bench arguments' fault
    # the bench's own parser, now, with the stage's own --json (and DCPKIT_TIMEOUT_MS): a bad
    # argument stops the suite here, not after the tests
    # shellcheck disable=SC2086
    if ! why="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m dcpkit bench --check-args \
            --json "$CHECK_DIR/dcpkit_suite_check.json" ${DCPKIT_BENCH_ARGS:-} 2>&1)"; then
        why="$(echo "$why" | tail -n 1)"
        if [[ $why == *": environment variable "* ]]; then
            echo "gpu_suite.sh: the bench stage would stop: $why" >&2  # names the variable
        else
            echo "gpu_suite.sh: DCPKIT_BENCH_ARGS must be arguments dcpkit bench accepts" \
                 "(got '${DCPKIT_BENCH_ARGS:-}'): $why" >&2
        fi
        exit 2
    fi
fi
if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then
    echo "gpu_suite.sh: OUT must be a directory (got '$OUT', which is not one)" >&2; exit 2
fi
if ! mkdir -p "$OUT" 2>/dev/null || [ ! -w "$OUT" ]; then
    echo "gpu_suite.sh: OUT must be a writable directory or one that can be created" \
         "(got '$OUT')" >&2; exit 2
fi
START_S=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dcpkit_suite.XXXXXX")"
LOGS="$WORK/logs"
mkdir -p "$LOGS"
SUMMARY="$WORK/summary.txt"
: >"$SUMMARY"
RESULTS=()   # "stage|N|rc|seconds|note"

say() { echo "[suite $(( $(date +%s) - START_S ))s] $*"; }

# ----------------------------------------------------------------------------- multicast guard
GUARD_VARS="NCCL_NVLS_ENABLE NVSHMEM_DISABLE_NVLS TORCH_SYMM_MEM_DISABLE_MULTICAST DCPKIT_DISABLE_MULTICAST"
declare -A GUARD0
for v in $GUARD_VARS; do
    if [ -n "${!v+x}" ]; then GUARD0[$v]="set:${!v}"; else GUARD0[$v]="unset"; fi
done
guard_check() {
    local v now
    for v in $GUARD_VARS; do
        if [ -n "${!v+x}" ]; then now="set:${!v}"; else now="unset"; fi
        if [ "$now" != "${GUARD0[$v]}" ]; then
            say "FATAL: $v changed from ${GUARD0[$v]} to $now; stopping (multicast safety)"
            exit 3
        fi
    done
}

# ----------------------------------------------------------------------------- finish (always)
finish() {
    local rc=$?
    trap - EXIT
    mps_stop 2>/dev/null
    {
        echo "# dcpkit GPU suite, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)," \
             "commit ${DCPKIT_COMMIT:-unknown}"
        echo "# stage world_size rc seconds note"
        for r in "${RESULTS[@]}"; do echo "$r" | tr '|' ' '; done
        echo
        cat "$LOGS/env.txt" 2>/dev/null
    } >"$SUMMARY"
    cp "$SUMMARY" "$OUT/summary.txt"
    # every result goes into the tarball; the first MAX_FILES - 2 (in the order of the header)
    # also into $OUT, beside summary.txt and logs.tar.gz
    mkdir -p "$LOGS/results"
    local f kept=0 left=()
    for f in "$WORK"/bench_[0-9]*.json "$WORK"/bench_base_*.json "$WORK"/demo_*.json \
             "$WORK"/bench_*.png "$WORK"/soak_*.json; do
        [ -f "$f" ] || continue
        cp "$f" "$LOGS/results/"
        if [ "$kept" -lt $(( MAX_FILES - 2 )) ]; then cp "$f" "$OUT/"; kept=$((kept + 1))
        else left+=("$(basename "$f")"); fi
    done
    [ "${#left[@]}" -gt 0 ] && echo "results only in logs.tar.gz (DCPKIT_SUITE_MAX_FILES=$MAX_FILES):" \
        "${left[*]}" >>"$SUMMARY" && cp "$SUMMARY" "$OUT/summary.txt"
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
    # the tail of a log can be huge; the tarball keeps everything, the table stays short
    echo
    echo "========== dcpkit GPU suite: summary ($(( $(date +%s) - START_S )) s) =========="
    printf '%-12s %-3s %-5s %-7s %s\n' stage N rc seconds note
    local failed=0
    for r in "${RESULTS[@]}"; do
        IFS='|' read -r s n c t note <<<"$r"
        printf '%-12s %-3s %-5s %-7s %s\n' "$s" "$n" "$c" "$t" "$note"
        case "$c" in 0|skip) ;; *) failed=1 ;; esac
    done
    echo "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
    [ "$rc" -ne 0 ] && exit "$rc"
    exit "$failed"
}
trap finish EXIT

# ----------------------------------------------------------------------------- environment
if [ -d "$ROOT/.whl" ] && ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --target /tmp/site "$ROOT"/.whl/*.whl \
            >"$LOGS/wheels.log" 2>&1; then
        export PYTHONPATH="$ROOT:/tmp/site"
    else
        say "installing .whl/*.whl failed (see logs/wheels.log); going on without them"
        export PYTHONPATH="$ROOT"
    fi
else
    export PYTHONPATH="$ROOT"
fi
if [ -z "${DCPKIT_COMMIT:-}" ]; then
    DCPKIT_COMMIT="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
fi
export DCPKIT_COMMIT

NGPU=0
command -v nvidia-smi >/dev/null 2>&1 && NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${NGPU:-0}" -eq 0 ]; then
    NGPU=$("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0)
fi
NPS=""
SHARED="${DCPKIT_SUITE_SHARED_GPU:-0}"
DEMO_SHARED=()
[ "$SHARED" = 1 ] && export DCPKIT_ALLOW_SHARED_GPU=1
for n in ${DCPKIT_SUITE_NP:-2 4}; do
    if [ "$n" -le "$NGPU" ]; then NPS="$NPS $n"
    elif [ "$SHARED" = 1 ] && [ "$NGPU" -ge 1 ]; then
        NPS="$NPS $n"; DEMO_SHARED=(--allow-shared-gpu)
        say "world size $n on $NGPU GPU(s): ranks share GPUs (no NVLink: timings bound the kernels on this machine, not NVLink)"
    else say "world size $n skipped: $NGPU GPU(s)"; fi
done
GPU_NAME=""
command -v nvidia-smi >/dev/null 2>&1 &&
    GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
export DCPKIT_MACHINE_KIND="${DCPKIT_MACHINE_KIND:-${NGPU}x ${GPU_NAME:-GPU}}"

{
    echo "## environment"
    echo "host: $(hostname); $(uname -r); GPUs: $NGPU; world sizes: ${NPS:- none}"
    echo "commit: $DCPKIT_COMMIT"
    for v in $GUARD_VARS; do echo "$v: ${GUARD0[$v]}"; done
    echo "DCPKIT_MULTICAST: ${DCPKIT_MULTICAST-unset}"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>&1
        nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,power.limit \
            --format=csv 2>&1
        nvidia-smi topo -m 2>&1
    else
        echo "nvidia-smi: not installed on this machine"
    fi
    if command -v "$PY" >/dev/null 2>&1; then echo "python: $("$PY" --version 2>&1)"
    else echo "python: '$PY' not found"; fi
    "$PY" -m pip list 2>/dev/null | grep -iE '^(cupy|cuda-(bindings|python|core)|torch|mpi4py)'
    "$PY" -m pip list 2>/dev/null | grep -iE '^(numpy|ml.dtypes|nvidia-nccl|nvshmem|pytest|matplotlib)'
    if command -v mpirun >/dev/null 2>&1; then echo "mpirun: $(mpirun --version 2>&1 | head -1)"
    else echo "mpirun: not installed on this machine"; fi
} >"$LOGS/env.txt" 2>&1
say "environment: $NGPU GPU(s), world sizes:${NPS:- none}, commit ${DCPKIT_COMMIT:0:12}"
for v in $GUARD_VARS; do say "  $v: ${GUARD0[$v]}"; done

MPI_FLAGS=(-x PYTHONPATH -x DCPKIT_COMMIT -x DCPKIT_MACHINE_KIND)
[ "$SHARED" = 1 ] && MPI_FLAGS+=(-x DCPKIT_ALLOW_SHARED_GPU)
if mpirun --version 2>&1 | grep -qi "open mpi"; then
    MPI_OPENMPI=1
    [ "$(id -u)" = 0 ] && MPI_FLAGS+=(--allow-run-as-root)
    MPI_FLAGS+=(--oversubscribe)
else
    MPI_OPENMPI=0
    MPI_FLAGS=()
fi

# ----------------------------------------------------------------------------- stage runner
# run_stage NAME N CAP_S LOG CMD...: bounded by min(CAP_S, what is left of the budget - 40 s).
run_stage() {
    local name=$1 n=$2 cap=$3 log=$4
    shift 4
    guard_check
    local left=$(( BUDGET_S - ($(date +%s) - START_S) - 40 ))
    local lim=$cap
    [ "$left" -lt "$lim" ] && lim=$left
    if [ "$lim" -lt 20 ]; then
        RESULTS+=("$name|$n|skip|0|out of time budget")
        say "$name N=$n: skipped (out of the ${BUDGET_S} s budget)"
        return 0
    fi
    say "$name N=$n: start (limit ${lim} s): $*"
    local t0=$(date +%s)
    timeout -k 15 "$lim" "$@" >"$log" 2>&1
    local rc=$?
    local dt=$(( $(date +%s) - t0 ))
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note="timed out after ${lim} s"
    elif [ "$rc" -eq 127 ] && ! command -v "$1" >/dev/null 2>&1; then
        note="'$1' cannot run: command not found"
    else
        # pytest's last summary line, or the benchmark's / demo's last line
        local pat=' (passed|failed|error|errors|skipped|no tests ran)( |,|$)|^# dcpkit bench:|^dcpkit demo'
        note="$(grep -E "$pat" "$log" 2>/dev/null | tail -1 | tr -d '=' | sed 's/^ *//' | cut -c1-90)"
    fi
    RESULTS+=("$name|$n|$rc|$dt|$note")
    if [ "$rc" -eq 0 ]; then
        say "$name N=$n: ok in ${dt} s ${note:+($note)}"
    else
        say "$name N=$n: exit $rc after ${dt} s ${note:+($note)}; last lines of $(basename "$log"):"
        tail -n 25 "$log" | cut -c1-200
    fi
    return 0
}

mpicmd() {  # mpicmd N TAG [VAR...]: sets MPICMD to the mpirun prefix, per-rank logs under
            # logs/TAG; each VAR (set in the caller's environment) is passed to the ranks too
    local n=$1 tag=$2 v
    shift 2
    if [ "$MPI_OPENMPI" = 1 ]; then
        MPICMD=(mpirun "${MPI_FLAGS[@]}")
        for v in "$@"; do MPICMD+=(-x "$v"); done
        MPICMD+=(--output-filename "$LOGS/$tag" -np "$n")
    else
        MPICMD=(mpirun -np "$n")   # MPICH's hydra passes the whole environment
    fi
}

# bench_env N: the environment of the bench stages at world size N (as "VAR=value" words):
# with ranks sharing a GPU under MPS, each rank's share of it (NVSHMEM's on-stream collectives
# abort without one; dcpkit gets the same share, so both are measured alike).
bench_env() {
    BENCH_ENV=()
    BENCH_VARS=()
    if [ "$MPS_ON" = 1 ] && [ "$1" -gt "$NGPU" ]; then
        if [ -z "${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE:-}" ]; then
            BENCH_ENV+=("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$(( 100 * NGPU / $1 ))")
        else
            BENCH_ENV+=("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        fi
        BENCH_VARS+=(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
    fi
}

# ----------------------------------------------------------------------------- MPS (shared GPU)
# With ranks sharing a GPU, their kernels only alternate at time-slice boundaries (~2 ms), so
# every collective call costs a time slice. DCPKIT_SUITE_MPS=1 starts an MPS control daemon of
# this machine's own (a user-space process; no GPU setting is changed) so that the ranks' kernels
# run concurrently, checks with a 2-rank heap + op smoke test that cuMem fd import works under
# it, and stops it again if not (and always at the end).
MPS_ON=0
mps_stop() {
    if [ "$MPS_ON" = 1 ]; then
        echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
        sleep 1
        MPS_ON=0
        say "MPS daemon stopped"
    fi
}
if [ "${DCPKIT_SUITE_MPS:-0}" = 1 ] && [ -n "$NPS" ]; then
    if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/dcpkit_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dcpkit_mps_log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        MPI_FLAGS+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
        if nvidia-cuda-mps-control -d >"$LOGS/mps.log" 2>&1; then
            MPS_ON=1
            mpicmd 2 mps_probe
            if timeout -k 5 120 "${MPICMD[@]}" "$PY" -m pytest -p no:cacheprovider -q -x \
                    tests/mpi/test_symmetric.py tests/mpi/test_lse_reduce.py \
                    -k "peer_wrote_cumem or epoch_wrap" >"$LOGS/mps_probe.log" 2>&1; then
                say "MPS daemon running: ranks sharing a GPU run concurrently"
                RESULTS+=("mps|2|0|0|MPS daemon used (ranks share the GPU concurrently)")
            else
                say "MPS probe failed (see logs/mps_probe.log); going on without MPS"
                tail -n 15 "$LOGS/mps_probe.log" | cut -c1-200
                RESULTS+=("mps|2|1|0|MPS probe failed: running without MPS")
                mps_stop
            fi
        else
            say "nvidia-cuda-mps-control -d failed (see logs/mps.log); going on without MPS"
        fi
    else
        say "no nvidia-cuda-mps-control on this machine; going on without MPS"
        RESULTS+=("mps|-|skip|0|nvidia-cuda-mps-control not found")
    fi
fi

# ----------------------------------------------------------------------------- stages
if [[ $STAGES == *,info,* ]]; then
    run_stage info - 120 "$LOGS/info.log" "$PY" -m dcpkit info
    head -c 3000 "$LOGS/info.log"
fi

# No Python: nothing can run, and "no GPU" would be the wrong reason.
if ! "$PY" -c pass >/dev/null 2>&1; then
    say "the Python interpreter '$PY' cannot run (set PYTHON to one with dcpkit's" \
        "dependencies); no stage can run"
    RESULTS+=("python|-|2|0|'$PY' cannot run: no stage run")
    exit 2
fi
# No GPU: every later stage needs one. Say so and fail (exit 2) instead of dropping them all and
# reporting success.
if [ "${NGPU:-0}" -eq 0 ]; then
    say "no GPU found on this machine (nvidia-smi lists none and CuPy counts none): the GPU" \
        "suite needs GPUs; stages after info not run (see 'python -m dcpkit info' above)"
    RESULTS+=("gpus|-|2|0|no GPU found: stages after info not run")
    exit 2
fi
# Requested stages that run under mpirun with no world size left (every DCPKIT_SUITE_NP size
# above the GPU count): a failure, not a silent skip.
if [ -z "$NPS" ]; then
    DROPPED=()
    [[ $STAGES == *,tests,* || $STAGES == *,mpitests,* ]] && DROPPED+=(mpitests)
    [[ $STAGES == *,demo,* ]] && [ -z "${DCPKIT_SUITE_DEMO_NP:-}" ] && DROPPED+=(demo)
    [[ $STAGES == *,bench,* ]] && [ -z "${DCPKIT_SUITE_BENCH_NP:-}" ] && DROPPED+=(bench)
    for st in ${DROPPED[@]+"${DROPPED[@]}"}; do
        say "stage $st not run: no world size of '${DCPKIT_SUITE_NP:-2 4}' fits $NGPU GPU(s)" \
            "(set DCPKIT_SUITE_NP, or DCPKIT_SUITE_SHARED_GPU=1)"
        RESULTS+=("$st|-|1|0|not run: no world size of '${DCPKIT_SUITE_NP:-2 4}' fits $NGPU GPU(s)")
    done
fi

if [[ $STAGES == *,tests,* || $STAGES == *,mpitests,* ]]; then
    for n in $NPS; do
        mpicmd "$n" "tests_mpi_$n"
        # shellcheck disable=SC2086
        run_stage mpitests "$n" "${DCPKIT_SUITE_MPI_CAP_S:-400}" "$LOGS/tests_mpi_$n.log" \
            "${MPICMD[@]}" "$PY" -m pytest tests/mpi -p no:cacheprovider -q \
            ${DCPKIT_SUITE_MPI_XFLAG--x} -rfEs --timeout="${DCPKIT_SUITE_TEST_TIMEOUT_S:-300}" \
            ${DCPKIT_PYTEST_ARGS:-}
    done
fi

if [[ $STAGES == *,tests,* || $STAGES == *,gputests,* ]]; then
    if [ -d "$ROOT/tests/gpu" ]; then
        run_stage gputests 1 300 "$LOGS/tests_gpu.log" \
            "$PY" -m pytest tests/gpu -p no:cacheprovider -q -rfEs --timeout=300 \
            ${DCPKIT_PYTEST_ARGS:-}
    fi
fi

if [[ $STAGES == *,overhead,* ]]; then
    for n in ${DCPKIT_SUITE_OVERHEAD_NP:-2}; do
        mpicmd "$n" "overhead_$n"
        run_stage overhead "$n" 120 "$LOGS/overhead_$n.log" \
            "${MPICMD[@]}" "$PY" scripts/host_overhead.py --json "$LOGS/overhead_$n.json"
        grep -E "us/call" "$LOGS/overhead_$n.log" | head -5
    done
fi

if [[ $STAGES == *,programmatic,* ]]; then
    for n in ${DCPKIT_SUITE_PROGRAMMATIC_NP:-2}; do
        bench_env "$n"
        mpicmd "$n" "programmatic_$n" ${BENCH_VARS[@]+"${BENCH_VARS[@]}"}
        run_stage programmatic "$n" 180 "$LOGS/programmatic_$n.log" \
            env ${BENCH_ENV[@]+"${BENCH_ENV[@]}"} \
            "${MPICMD[@]}" "$PY" scripts/programmatic_launch.py --json "$LOGS/programmatic_$n.json"
        [ -f "$LOGS/programmatic_$n.log" ] && tail -n 12 "$LOGS/programmatic_$n.log" | cut -c1-160
    done
fi

if [[ $STAGES == *,probe,* ]]; then
    for n in ${DCPKIT_SUITE_PROBE_NP:-2}; do
        bench_env "$n"
        mpicmd "$n" "probe_$n" ${BENCH_VARS[@]+"${BENCH_VARS[@]}"}
        run_stage probe "$n" 180 "$LOGS/probe_$n.log" \
            env ${BENCH_ENV[@]+"${BENCH_ENV[@]}"} \
            "${MPICMD[@]}" "$PY" scripts/protocol_probe.py --tokens 1,4,8 --json "$LOGS/probe_$n.json"
        [ -f "$LOGS/probe_$n.log" ] && tail -n 16 "$LOGS/probe_$n.log" | cut -c1-160
    done
fi

if [[ $STAGES == *,soak,* ]]; then
    for n in ${DCPKIT_SUITE_SOAK_NP:-4}; do
        mpicmd "$n" "soak_$n"
        run_stage soak "$n" "${DCPKIT_SUITE_SOAK_CAP_S:-240}" "$LOGS/soak_$n.log" \
            "${MPICMD[@]}" "$PY" scripts/soak.py --calls "${DCPKIT_SUITE_SOAK_CALLS:-100000}" \
            --json "$WORK/soak_$n.json"
        tail -n 6 "$LOGS/soak_$n.log" | cut -c1-200
    done
fi

if [[ $STAGES == *,demo,* ]]; then
    if [ -f "$ROOT/dcpkit/demo.py" ] || [ -d "$ROOT/dcpkit/demo" ]; then
        for n in ${DCPKIT_SUITE_DEMO_NP:-$NPS}; do
            mpicmd "$n" "demo_$n"
            run_stage demo "$n" 180 "$LOGS/demo_$n.log" \
                "${MPICMD[@]}" "$PY" -m dcpkit demo --json "$WORK/demo_$n.json" ${DEMO_SHARED[@]+"${DEMO_SHARED[@]}"}
        done
    else
        RESULTS+=("demo|-|skip|0|dcpkit.demo not in this checkout")
    fi
fi

BASE="${DCPKIT_SUITE_BASELINE:-}"
stamp_commit() {  # stamp_commit JSON COMMIT: meta.commit of a bench JSON set to COMMIT
    [ -f "$1" ] && [ -n "$2" ] && [ "$2" != unknown ] || return 0
    "$PY" - "$1" "$2" <<'PYEOF' || say "could not stamp commit $2 into $1"
import json, sys
path, commit = sys.argv[1], sys.argv[2]
with open(path, encoding="utf-8") as f:
    res = json.load(f)
meta = res.setdefault("meta", {})
if meta.get("commit") != commit:  # what git said described another tree: its state too
    meta["commit"] = commit
    meta["commit_dirty"] = None
    with open(path, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
PYEOF
}

if [[ $STAGES == *,bench,* ]] && [ -n "$BASE" ]; then  # a dcpkit checkout (checked above)
    BASE="$(cd "$BASE" && pwd)"
    BASE_COMMIT="${DCPKIT_SUITE_BASELINE_COMMIT:-$(git -C "$BASE" rev-parse HEAD 2>/dev/null || echo unknown)}"
    BASE_PYTHONPATH="$BASE${PYTHONPATH#"$ROOT"}"   # the baseline first, the same wheels
    say "baseline: $BASE (commit ${BASE_COMMIT:0:12})"
fi

if [[ $STAGES == *,bench,* ]]; then
    # dcpkit bench refuses --plot without matplotlib: without it, the tables and JSON only
    PLOT=1
    if ! "$PY" -c "import matplotlib" >/dev/null 2>&1; then
        PLOT=""
        say "bench: matplotlib is not installed (pip install 'dcpkit[bench]'): no bench_N.png"
    fi
    for n in ${DCPKIT_SUITE_BENCH_NP:-$NPS}; do
        bench_env "$n"
        if [ -n "$BASE" ]; then
            # from the baseline's own folder, so that its dcpkit (not this one) is imported
            mpicmd "$n" "bench_base_$n" ${BENCH_VARS[@]+"${BENCH_VARS[@]}"}
            run_stage bench_base "$n" 300 "$LOGS/bench_base_$n.log" \
                bash -c 'cd "$0" && exec "$@"' "$BASE" \
                env PYTHONPATH="$BASE_PYTHONPATH" DCPKIT_COMMIT="$BASE_COMMIT" \
                ${BENCH_ENV[@]+"${BENCH_ENV[@]}"} \
                "${MPICMD[@]}" "$PY" -m dcpkit bench --quick --json "$WORK/bench_base_$n.json"
            # an older dcpkit may not read DCPKIT_COMMIT: the JSON names the baseline's commit
            stamp_commit "$WORK/bench_base_$n.json" "$BASE_COMMIT"
        fi
        mpicmd "$n" "bench_$n" ${BENCH_VARS[@]+"${BENCH_VARS[@]}"}
        # shellcheck disable=SC2086
        run_stage bench "$n" 400 "$LOGS/bench_$n.log" \
            env ${BENCH_ENV[@]+"${BENCH_ENV[@]}"} \
            "${MPICMD[@]}" "$PY" -m dcpkit bench --json "$WORK/bench_$n.json" \
            ${PLOT:+--plot "$WORK/bench_$n.png"} ${DCPKIT_BENCH_ARGS:-}
        # the compact part of the bench output: ceilings, target counts, the last line
        grep -E '^# (ceilings|targets:|dcpkit bench:)|^#   ' "$LOGS/bench_$n.log" \
            | cut -c1-160 | tail -n 12
    done
fi
exit 0
