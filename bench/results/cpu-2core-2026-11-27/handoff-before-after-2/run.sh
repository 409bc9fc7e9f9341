#!/usr/bin/env bash
# bench.handoff before (e6fb549, the tree before issue 22's redesign) and after (main at 15a1de0),
# interleaved pairs: ./run.sh 1 2 3 ... writes before-N.json and after-N.json into $OUT (default .).
set -u
PY=/work/main/.venv/bin/python
OUT=${OUT:-.}
for i in "$@"; do
  for tree in before after; do
    if [ $tree = before ]; then dir=/tmp/oldtree; else dir=/tmp/newtree; fi
    (cd $dir && PYTHONPATH=$dir $PY -m bench.handoff --json --no-relay --sessions 2,64 > "$OUT/$tree-$i.json" 2>"$OUT/$tree-$i.err")
    echo "$tree $i rc=$? $(date +%T)"
  done
done
