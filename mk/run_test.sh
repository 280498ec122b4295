#!/usr/bin/env bash
# mk/run_test.sh — the recipe of `make test` (mk/check.mk): every stage, each
# counted from its log (mk/stage_counts.py), then the closing summary.
#
#   run_test.sh "FIRST STAGES" "MAIN LANE" "SIDE LANE" SUMMARY-COMMAND...
#
# The first stages (the build, then every venv install) run one after the
# other; a failed build stops the run. Then two lanes run side by side: the
# pytest stages (the main lane), which leave a core idle between the library's
# calls, and the checks that are mostly one process at a time (Swift tests,
# cross-builds under qemu, the macOS type-check, linters). Lane stages run with
# the build and the install taken as done (make -o), so no two processes
# build, install or write the venv at once. The main lane prints as it runs;
# each side stage's log is printed when the main lane has ended.
# Every stage runs (a failure does not hide the later ones); the exit status is
# non-zero when any stage failed. Needs MAKE, PYTHON and TEST_SUMMARY.
set -u
first=$1 main=$2 side=$3
shift 3
mkdir -p .build
rm -f "$TEST_SUMMARY" .build/stage-*.counts
done_targets=(-o build -o python -o venv)

# stage NAME [make options]: runs `make NAME`, its log in .build/stage-NAME.log
# (and on stdout unless QUIET=1), its counts line in .build/stage-NAME.counts.
stage() {
    local t=$1 start rc
    shift
    start=$(date +%s)
    if [ "${QUIET:-0}" = 1 ]; then
        "$MAKE" --no-print-directory "$@" "$t" > ".build/stage-$t.log" 2>&1
        rc=$?
    else
        echo "== make $t"
        "$MAKE" --no-print-directory "$@" "$t" 2>&1 | tee ".build/stage-$t.log"
        rc=${PIPESTATUS[0]}
    fi
    "$PYTHON" mk/stage_counts.py "$t" "$rc" ".build/stage-$t.log" $(($(date +%s) - start)) \
        > ".build/stage-$t.counts" || rc=1
    return "$rc"
}

status=0 built=1 wall_start=$(date +%s)
for t in $first; do
    stage "$t" || { status=1; [ "$t" = all ] && { built=0; break; }; }
done
if [ "$built" = 1 ]; then
    (
        side_status=0
        for t in $side; do QUIET=1 stage "$t" "${done_targets[@]}" || side_status=1; done
        exit "$side_status"
    ) &
    side_pid=$!
    for t in $main; do stage "$t" "${done_targets[@]}" || status=1; done
    wait "$side_pid" || status=1
    for t in $side; do
        echo "== make $t (beside the main lane)"
        cat ".build/stage-$t.log"
    done
fi

for t in $first $main $side; do
    [ -e ".build/stage-$t.counts" ] && cat ".build/stage-$t.counts" >> "$TEST_SUMMARY"
done
[ "$status" -ne 0 ] || "$@" || status=1
"$PYTHON" mk/stage_counts.py --total "$TEST_SUMMARY" $(($(date +%s) - wall_start)) || status=1
exit "$status"
