#!/bin/bash
# Every prototype run behind DESIGN.md's findings; results in $R (default /tmp/ppp), summary in $R/summary.txt
P=$(cd "$(dirname "$0")/../../.." && pwd)/.venv/bin/python; R=${R:-/tmp/ppp}; cd "$(dirname "$0")"
run() { name=$1; shift; rm -rf $R/$name; echo "== $name: $*" >> $R/summary.txt; $P pp_run.py launch --out $R/$name "$@" >> $R/summary.txt 2>&1; }
mkdir -p $R
for s in 1f1b gpipe interleaved; do
  [ -e $R/ref_${s}_pp2/rank0.json ] || run ref_${s}_pp2 --pp 2 --sched $s --mode ref
  run kill_${s}_pp2 --pp 2 --sched $s --mode kill --at 5
done
for m in rebuild rebuild-all swapgroup; do run ${m}_1f1b_pp2 --pp 2 --sched 1f1b --mode $m --at 5; done
run rebuild_interleaved_pp2 --pp 2 --sched interleaved --mode rebuild --at 5
run ref_1f1b_pp2_static2 --pp 2 --sched 1f1b --mode ref --static
run rebuild_1f1b_pp2_static2 --pp 2 --sched 1f1b --mode rebuild --at 5 --static
run ref_1f1b_pp4 --pp 4 --sched 1f1b --mode ref
run kill_1f1b_pp4 --pp 4 --sched 1f1b --mode kill --at 5 --victim 2
run ref_1f1b_pp4_6steps --pp 4 --sched 1f1b --mode ref --steps 6
run resume_pp4to2 --pp 2 --sched 1f1b --mode resume --from $R/ref_1f1b_pp4_6steps --start-step 6
echo "== compare" >> $R/summary.txt
for s in 1f1b gpipe interleaved; do $P compare.py $R/ref_${s}_pp2 $R/kill_${s}_pp2 >> $R/summary.txt; done
$P compare.py $R/ref_1f1b_pp2 $R/rebuild_1f1b_pp2 $R/rebuild-all_1f1b_pp2 $R/swapgroup_1f1b_pp2 $R/ref_1f1b_pp2_static2 $R/rebuild_1f1b_pp2_static2 $R/ref_1f1b_pp4 $R/kill_1f1b_pp4 $R/resume_pp4to2 $R/ref_gpipe_pp2 $R/ref_interleaved_pp2 >> $R/summary.txt
$P compare.py $R/ref_interleaved_pp2 $R/rebuild_interleaved_pp2 >> $R/summary.txt
$P compare.py $R/ref_1f1b_pp4 $R/kill_1f1b_pp4 >> $R/summary.txt
echo ALLDONE >> $R/summary.txt
