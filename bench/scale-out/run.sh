#!/usr/bin/env bash
# Measures the PL/Proxy router (docs/scale-out.md, "Measured"), with pgbench, in interleaved
# rounds so that both sides of each ratio see the same machine:
#   1. produce to one stream through the router against directly on its shard;
#   2. produce to three streams through the router, all on one shard against one on each shard.
# Prints each round's transactions per second and the median ratios.
#
#   bench/scale-out/run.sh ROUTER_CONNINFO SHARD_CONNINFO STREAM ONE_A ONE_B ONE_C SPREAD_A SPREAD_B SPREAD_C
#
# STREAM lives on SHARD; ONE_* are three streams placed on one shard, SPREAD_* three on three
# shards (SELECT shard, name FROM sqlstreams.streams on the router says where each is).
set -euo pipefail
[ $# -eq 9 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
router=$1 shard=$2 stream=$3
ROUNDS=${ROUNDS:-3} SECONDS_PER_RUN=${SECONDS_PER_RUN:-10} CLIENTS=${CLIENTS:-3}
placed() { psql "$router" -XAtqc "SELECT shard FROM sqlstreams_router.locate('$1')"; }
for set in "$4 $5 $6" "$7 $8 $9"; do
  echo "placement: $(for s in $set; do printf '%s on shard %s; ' "$s" "$(placed "$s")"; done)"
done
[ "$(placed "$4")" = "$(placed "$5")" ] && [ "$(placed "$5")" = "$(placed "$6")" ] \
  || { echo "run.sh: $4, $5 and $6 must be on one shard" >&2; exit 2; }
[ "$(printf '%s\n' "$(placed "$7")" "$(placed "$8")" "$(placed "$9")" | sort -u | wc -l)" = 3 ] \
  || { echo "run.sh: $7, $8 and $9 must be on three shards" >&2; exit 2; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf "SELECT sqlstreams.produce('%s', '{\"n\": 1}', 'k' || (random() * 100)::int);\n" "$stream" > "$dir/one_stream.sql"
for set in one spread; do
  if [ $set = one ]; then a=$4 b=$5 c=$6; else a=$7 b=$8 c=$9; fi
  printf "\\\\set s random(1, 3)\nSELECT sqlstreams.produce((ARRAY['%s', '%s', '%s'])[:s], '{\"n\": 1}', 'k' || (random() * 100)::int);\n" \
    "$a" "$b" "$c" > "$dir/$set.sql"
done
tps() { pgbench -n -T "$SECONDS_PER_RUN" -c "$CLIENTS" -j "$CLIENTS" -f "$2" "$1" 2>/dev/null | sed -n 's/^tps = \([0-9.]*\).*/\1/p'; }
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
: > "$dir/direct_ratio"; : > "$dir/spread_ratio"
for round in $(seq 1 "$ROUNDS"); do
  direct=$(tps "$shard" "$dir/one_stream.sql"); routed=$(tps "$router" "$dir/one_stream.sql")
  one=$(tps "$router" "$dir/one.sql"); spread=$(tps "$router" "$dir/spread.sql")
  echo "round $round: produce/s direct $direct, through the router $routed; 3 streams on 1 shard $one, on 3 shards $spread"
  awk -v r="$routed" -v d="$direct" 'BEGIN { print r / d }' >> "$dir/direct_ratio"
  awk -v s="$spread" -v o="$one" 'BEGIN { print s / o }' >> "$dir/spread_ratio"
done
echo "router / direct (median of $ROUNDS): $(median < "$dir/direct_ratio")"
echo "3 shards / 1 shard (median of $ROUNDS): $(median < "$dir/spread_ratio")"
