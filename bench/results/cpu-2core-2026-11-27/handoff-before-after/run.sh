#!/usr/bin/env bash
# bench.handoff before (e6fb549, the tree before issue 22's redesign) and after (this tree), interleaved.
set -u
PY=/work/main/.venv/bin/python
for i in 4 5 6; do
  for tree in before after; do
    if [ $tree = before ]; then dir=/tmp/oldtree; else dir=/work/int; fi
    (cd $dir && PYTHONPATH=$dir $PY -m bench.handoff --json --no-relay --sessions 2,64 > /tmp/ba/$tree-$i.json 2>/tmp/ba/$tree-$i.err)
    echo "$tree $i rc=$?"
  done
done
