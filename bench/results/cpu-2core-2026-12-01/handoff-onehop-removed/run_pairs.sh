#!/bin/bash
# Interleaved pairs of bench.handoff, ABBA order: BEFORE's tree (main before issue 31) and AFTER's
# (one-hop removed), one after the other, each its own daemon; JSON to OUT as handoff-{before,after}-N.json.
#   BEFORE=/path/main-tree AFTER=/path/new-tree OUT=dir PY=.venv/bin/python PAIRS="1 2 3" bash run_pairs.sh
run() {  # tree label index
    ( cd "$1" && PYTHONPATH="$1" timeout 300 "$PY" -m bench.handoff --sessions 2,64 --json \
        > "$OUT/handoff-$2-$3.json" 2> "$OUT/handoff-$2-$3.err" )
    echo "$2-$3 rc=$? $(date +%T) load=$(cut -d' ' -f1-3 /proc/loadavg)"
}
for i in ${PAIRS:-1 2 3 4 5 6}; do
    if [ $((i % 2)) = 1 ]; then run "$BEFORE" before "$i"; run "$AFTER" after "$i"
    else run "$AFTER" after "$i"; run "$BEFORE" before "$i"; fi
done
