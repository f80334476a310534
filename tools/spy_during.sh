#!/bin/bash
# py-spy the processes of a running benchmark once its log shows a line: for profiling served
# processes on a device machine (py-spy carried as a wheel in .whl/, installed to /tmp/site).
#
#   bash tools/spy_during.sh LOG REGEX SECONDS OUTDIR 'pgrep pattern' ['pgrep pattern' ...]
#
# Waits (up to 20 min) for REGEX in LOG, then records every process matching each pattern for
# SECONDS at 250 Hz, raw folded stacks with thread ids (OUTDIR/spy_<n>_<pid>.txt, one per
# process), and with SPY_GIL=1 a second recording of the threads holding the GIL (.gil.txt).
set -u
log=$1 regex=$2 seconds=$3 outdir=$4
shift 4
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
for _ in $(seq 1200); do
    grep -qE "$regex" "$log" 2> /dev/null && break
    sleep 1
done
mkdir -p "$outdir"
n=0
for pattern in "$@"; do
    for pid in $(pgrep -f "python.*$pattern"); do
        [ "$pid" = $$ ] && continue
        "$spy" record -p "$pid" -d "$seconds" -r 250 --threads --nonblocking -f raw -o "$outdir/spy_${n}_$pid.txt" \
            > "$outdir/spy_${n}_$pid.log" 2>&1 &
        if [ "${SPY_GIL:-0}" = 1 ]; then
            "$spy" record -p "$pid" -d "$seconds" -r 250 --threads --gil --nonblocking -f raw \
                -o "$outdir/spy_${n}_$pid.gil.txt" > /dev/null 2>&1 &
        fi
        tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-200 > "$outdir/spy_${n}_$pid.cmd"
    done
    n=$((n + 1))
done
wait
