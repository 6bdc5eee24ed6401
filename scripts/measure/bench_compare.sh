#!/usr/bin/env bash
# Compare one `grpo-parts bench ...` between two revisions, side by side on this machine.
#
#   scripts/measure/bench_compare.sh [--rounds N] [--json PATH] REV_A REV_B BENCH [bench args...]
#   scripts/measure/bench_compare.sh 48911eb HEAD attention --quick
#
# Each revision's source is checked out into its own temporary worktree (`git worktree add
# --detach`; REV "." means this checkout's files as they are, uncommitted changes included). The same
# bench command then runs alternately for A and B (A B, B A, A B, ...: drift in the machine's load hits
# both alike), N rounds (default 3), each run in a fresh process of the same Python with
# PYTHONPATH=<worktree>/src, so the revision's grpo_parts is imported even where the package is
# installed editable from another checkout (checked: the run fails otherwise). Each run writes the
# bench's --json; the table gives, per point, each revision's `speedup` (optimized vs reference in the
# same process) as min / median over the rounds, B's median over A's, and, where the bench reports an
# ideal ratio, B's median as a fraction of it; a second table gives each arm's own time (the bench's
# `time_*_s` keys, medians), since a ratio can drop because the baseline got faster. A point's speedup is already a ratio measured in one
# process, so load on a shared machine mostly cancels; the rounds show how much it did not.
#
# Environment: PYTHON (default: python on PATH, e.g. the activated venv), BENCH_METRIC (default:
# speedup). The git repository is the one containing the current directory. Timing runs on a shared
# machine belong under `flock /tmp/bench.lock`.
set -euo pipefail

usage() {  # --help: on stdout, exit 0; a wrong call: on stderr, exit 2
    local rc=${1:-2}
    {
        echo "usage: scripts/measure/bench_compare.sh [--rounds N] [--json PATH] REV_A REV_B BENCH [bench args...]"
        echo "  e.g. scripts/measure/bench_compare.sh 48911eb HEAD attention --quick"
    } >&$(( rc == 0 ? 1 : 2 ))
    exit "$rc"
}

rounds=3
json_out=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --rounds) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { echo "bench_compare: --rounds: expected a positive integer, got '${2:-}'" >&2; exit 2; }; rounds=$2; shift 2 ;;
        --json) [[ $# -ge 2 ]] || usage; json_out=$2; shift 2 ;;
        -h|--help) usage 0 ;;
        *) break ;;
    esac
done
[[ $# -ge 3 ]] || usage
rev_a=$1 rev_b=$2
shift 2
bench_args=("$@")
for a in "${bench_args[@]}"; do
    [[ "$a" == --json* ]] && { echo "bench_compare: bench args: --json is set by this script (use bench_compare.sh --json PATH)" >&2; exit 2; }
done
py=${PYTHON:-python}
metric=${BENCH_METRIC:-speedup}

repo=$(git rev-parse --show-toplevel 2>/dev/null) || { echo "bench_compare: not inside a git repository: $PWD" >&2; exit 2; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench_compare.XXXXXX")
cleanup() {
    for n in A B; do
        [[ -d "$tmp/$n" ]] && git -C "$repo" worktree remove --force "$tmp/$n" >/dev/null 2>&1
    done
    rm -rf "$tmp"
    git -C "$repo" worktree prune >/dev/null 2>&1 || true
}
trap cleanup EXIT

checkout() {  # REV NAME: sets src_NAME and label_NAME
    local rev=$1 name=$2 sha
    if [[ "$rev" == "." ]]; then
        printf -v "src_$name" '%s' "$repo/src"
        printf -v "label_$name" '%s' ". (working tree of $(git -C "$repo" rev-parse --short=10 HEAD))"
        return
    fi
    sha=$(git -C "$repo" rev-parse --verify --quiet "$rev^{commit}") || {
        echo "bench_compare: REV_$name: '$rev' is not a commit of $repo (a shallow clone may lack it: git fetch --unshallow)" >&2
        exit 2
    }
    git -C "$repo" worktree add --detach --quiet "$tmp/$name" "$sha" >&2
    printf -v "src_$name" '%s' "$tmp/$name/src"
    printf -v "label_$name" '%s' "$rev (${sha:0:10})"
}
checkout "$rev_a" A
checkout "$rev_b" B

echo "bench_compare: grpo-parts bench ${bench_args[*]}"
echo "  A = $label_A"
echo "  B = $label_B"
echo "  $rounds rounds, alternating; python $("$py" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'); $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"

run_one() {  # NAME SRC ROUND
    local name=$1 src=$2 r=$3 out="$tmp/$1.$3.json" log="$tmp/$1.$3.log" t0=$SECONDS
    if ! PYTHONPATH="$src" "$py" - "$src" "${bench_args[@]}" --json "$out" >"$log" 2>&1 <<'EOF'
import os, sys
src = os.path.realpath(sys.argv[1])
import grpo_parts
got = os.path.realpath(grpo_parts.__file__)
if not got.startswith(src + os.sep):
    sys.exit(f"bench_compare: imported grpo_parts from {got}, not from {src}")
from grpo_parts.cli import main
sys.argv = ["grpo-parts", "bench", *sys.argv[2:]]
sys.exit(main())
EOF
    then
        echo "bench_compare: round $r, $name failed; its output:" >&2
        tail -n 30 "$log" >&2
        exit 1
    fi
    echo "  round $r: $name done in $((SECONDS - t0)) s"
}

for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(A B); else order=(B A); fi
    for n in "${order[@]}"; do
        if [[ $n == A ]]; then run_one A "$src_A" "$r"; else run_one B "$src_B" "$r"; fi
    done
done

"$py" - "$tmp" "$rounds" "$metric" "$json_out" "$label_A" "$label_B" <<'EOF'
import json, statistics, sys

tmp, rounds, metric, json_out, label_A, label_B = sys.argv[1:]
rounds = int(rounds)


def points(name, r):
    with open(f"{tmp}/{name}.{r}.json") as f:
        data = json.load(f)
    # a list of points, {"points": [...]}, or one summary object (bench e2e: one point)
    return (data["points"] if "points" in data else [data]) if isinstance(data, dict) else data


runs = {n: [points(n, r) for r in range(1, rounds + 1)] for n in "AB"}
n_points = {len(p) for n in "AB" for p in runs[n]}
if len(n_points) != 1:
    sys.exit(f"bench_compare: the runs report different numbers of points: {sorted(n_points)}")


def label(i):
    """The point's identity: its str/int fields that are equal in every run of both revisions."""
    rows = [p[i] for n in "AB" for p in runs[n]]
    keys = [k for k, v in rows[0].items() if isinstance(v, (str, int)) and not isinstance(v, bool)]
    same = [k for k in keys if all(r.get(k) == rows[0][k] for r in rows) and k not in ("kernel", "clock", "skipped")]
    return " ".join(f"{k}={rows[0][k]}" for k in same[:5]) or f"point {i}"


def fmt(v):
    return "-" if v is None else f"{v:.3f}"


out = []
print(f"\n{metric} per point (min / median over {rounds} rounds); B/A = B's median / A's median")
print(f"  A = {label_A}\n  B = {label_B}")
head = f"{'point':<28} {'A min':>7} {'A med':>7} {'B min':>7} {'B med':>7} {'B/A':>7} {'B/ideal':>8}"
print(head)
for i in range(n_points.pop()):
    vals = {n: [p[i].get(metric) for p in runs[n]] for n in "AB"}
    row = {"point": label(i), "A": vals["A"], "B": vals["B"]}
    if any(v is None for n in "AB" for v in vals[n]):
        why = next((p[i].get("skipped") for n in "AB" for p in runs[n] if p[i].get("skipped")), "no value")
        print(f"{row['point']:<28} skipped ({why})")
        row["skipped"] = why
        out.append(row)
        continue
    for n in "AB":
        row[f"{n}_min"], row[f"{n}_median"] = min(vals[n]), statistics.median(vals[n])
    row["B_over_A"] = row["B_median"] / row["A_median"] if row["A_median"] else None
    ideal = runs["B"][0][i].get("ideal")
    row["B_of_ideal"] = row["B_median"] / ideal if isinstance(ideal, (int, float)) and ideal else None
    print(
        f"{row['point']:<28} {fmt(row['A_min']):>7} {fmt(row['A_median']):>7} {fmt(row['B_min']):>7} "
        f"{fmt(row['B_median']):>7} {fmt(row['B_over_A']):>7} {fmt(row['B_of_ideal']):>8}"
    )
    out.append(row)

# The ratio hides which arm moved: print each arm's own time (the bench's `time_*_s` keys) per
# revision, so "B is slower" can be told apart from "B's baseline got faster".
time_keys = sorted({k for n in "AB" for p in runs[n] for pt in p for k in pt if k.startswith("time_") and k.endswith("_s")})
if time_keys:
    print(f"\nper-arm times in s (median over {rounds} rounds); B/A < 1: B faster")
    print(f"{'point':<28} {'arm':<14} {'A med':>8} {'B med':>8} {'B/A':>7}")
    for i, row in enumerate(out):
        if "skipped" in row:
            continue
        row["times"] = {}
        for k in time_keys:
            vals = {n: [p[i].get(k) for p in runs[n]] for n in "AB"}
            if any(v is None for n in "AB" for v in vals[n]):
                continue
            a, b = statistics.median(vals["A"]), statistics.median(vals["B"])
            row["times"][k] = {"A": vals["A"], "B": vals["B"], "A_median": a, "B_median": b, "B_over_A": b / a if a else None}
            print(f"{row['point']:<28} {k:<14} {a:>8.3f} {b:>8.3f} {fmt(b / a if a else None):>7}")
if json_out:
    with open(json_out, "w") as f:
        json.dump({"metric": metric, "rounds": rounds, "A": label_A, "B": label_B, "points": out}, f, indent=1)
    print(f"wrote {json_out}")
EOF
