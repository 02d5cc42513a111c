#!/usr/bin/env bash
# Three OpenAI-compatible servers, one client: mlx-tracer serve, llama.cpp's llama-server and
# mlx_lm.server, the same SmolLM2 model, the same threads, 127.0.0.1 only, each measured with
# ../shared/peers/serve_load.py (N concurrent streaming chat completions, greedy, max_tokens T).
#
#   benchmarks/serve_compare.sh [--clients 16,1] [--tokens 64] [--reps 2] [--threads 2]
#                               [--servers tracer,llama,mlxlm] [--slots 16] [--out DIR]
#
# For each repetition, for each server in turn (repetitions interleave between servers): start
# it on its own port, wait until it answers, warm it up (one request, then one round at the
# largest client count, 8 tokens), run serve_load.py once per client count (load average from
# `uptime` recorded before and after each run), stop it (SIGTERM, SIGKILL after 20 s). Prints
# one row per run and a summary (median over repetitions). Server logs and results.tsv go to
# --out (default /tmp/serve_compare.<time>). Nothing is left running on exit (trap).
#
# Run it on a quiet machine, not under nice: llama.cpp's threads spin at barriers and all
# three servers share the cores with the client.
#
# --servers may also name mlxlm-blas: mlx_lm.server with mlx-tracer imported first, so MLX's
# float matmuls (attention) go through mlx-tracer's BLAS shim instead of MLX's reference BLAS.
#
# Environment overrides: GGUF (the model file), MLX_LM_DIR (mlx-lm folder built from it,
# made by benchmarks/make_mlx_lm_model.py when missing), LLAMA_SERVER (binary), PY (python
# with httpx, mlx-lm, mlx-tracer), SERVE_LOAD (client script), PORT_BASE (8090), TRACER_WEIGHTS
# (mlx-tracer's --weights, default auto: what `mlx-tracer serve` picks, measured on this machine;
# quantized: the exact contract, mlx-lm's arithmetic; quantized-fast: llama.cpp's).
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PY="${PY:-$REPO/.venv/bin/python}"
TRACER="${TRACER:-$REPO/.venv/bin/mlx-tracer}"
MLX_LM_SERVER="${MLX_LM_SERVER:-$REPO/.venv/bin/mlx_lm.server}"
LLAMA_SERVER="${LLAMA_SERVER:-/work/llama-server/llama-server}"
SERVE_LOAD="${SERVE_LOAD:-$REPO/../shared/peers/serve_load.py}"
GGUF="${GGUF:-$HOME/.cache/mlx-tracer/SmolLM2-135M-Instruct.Q4_1.gguf}"
MLX_LM_DIR="${MLX_LM_DIR:-/tmp/smollm2-mlx}"
PORT_BASE="${PORT_BASE:-8090}"

CLIENTS="16,1"; TOKENS=64; REPS=2; THREADS=2; SERVERS="tracer,llama,mlxlm"; SLOTS=""
OUT="/tmp/serve_compare.$(date +%Y%m%d-%H%M%S)"
READY_TIMEOUT=900   # seconds a server may take to answer (mlx-tracer traces every bucket first)

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --clients) CLIENTS="$2"; shift 2;;
    --tokens) TOKENS="$2"; shift 2;;
    --reps) REPS="$2"; shift 2;;
    --threads) THREADS="$2"; shift 2;;
    --servers) SERVERS="$2"; shift 2;;
    --slots) SLOTS="$2"; shift 2;;
    --out) OUT="$2"; shift 2;;
    -h|--help) usage 0;;
    *) echo "unknown argument: $1" >&2; usage 2;;
  esac
done

die() { echo "serve_compare: $*" >&2; exit 1; }
[ -x "$PY" ] || die "no python at $PY"
"$PY" -c "import httpx" 2>/dev/null || die "$PY has no httpx (serve_load.py needs it)"
[ -f "$SERVE_LOAD" ] || die "no client script at $SERVE_LOAD"
[ -f "$GGUF" ] || die "no model file at $GGUF"
mkdir -p "$OUT" || die "cannot create $OUT"
RESULTS="$OUT/results.tsv"
printf 'server\tclients\trep\ttokens\twall_s\ttok_s\tttft_p50\tttft_max\tgap_max\tload_before\tload_after\n' > "$RESULTS"

MAXC=$(echo "$CLIENTS" | tr ',' '\n' | sort -n | tail -1)
NCPU=$(nproc)
# Rows each server can decode at once: mlx-tracer's largest bucket, llama-server's -np (1024
# tokens of context each), mlx_lm.server's --decode-concurrency (at least its default 32).
[ -n "$SLOTS" ] || SLOTS=$(( MAXC > 16 ? MAXC : 16 ))
# Same cores for every server: pin to the first THREADS cores when the machine has more.
PIN=()
if [ "$THREADS" -lt "$NCPU" ]; then PIN=(taskset -c "0-$((THREADS - 1))"); fi

SERVER_PID=""
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  local pid="$SERVER_PID"; SERVER_PID=""
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done  # SIGTERM: each server drains
    if kill -0 "$pid" 2>/dev/null; then
      echo "  (server $pid did not stop in 20 s: SIGKILL)" >&2
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null
    fi
  fi
  wait "$pid" 2>/dev/null || true
}
CHILD_PID=""
# Run a command in the background and wait for it, so that a signal to this script is handled
# at once (bash defers traps until a foreground child returns); the trap ends it too.
waitfor() {
  "$@" &
  CHILD_PID=$!
  wait "$CHILD_PID"; local rc=$?
  CHILD_PID=""
  return $rc
}
cleanup() {
  if [ -n "$CHILD_PID" ]; then kill -TERM "$CHILD_PID" 2>/dev/null; wait "$CHILD_PID" 2>/dev/null; fi
  stop_server
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

port_of() { case "$1" in tracer) echo "$PORT_BASE";; llama) echo $((PORT_BASE + 1));; mlxlm) echo $((PORT_BASE + 2));;
                          mlxlm-blas) echo $((PORT_BASE + 3));; esac; }
answers() { "$PY" - "$1" <<'EOF' 2>/dev/null
import sys, httpx
try:
    r = httpx.get(sys.argv[1] + "/v1/models", timeout=5)
    sys.exit(0 if r.status_code == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}

model_name() {  # the name each server wants in "model"
  case "$1" in
    tracer) "$PY" -c "import httpx,sys; print(httpx.get(sys.argv[1]+'/v1/models',timeout=10).json()['data'][0]['id'])" "$2";;
    llama) echo smollm2;;            # its -a alias (llama-server ignores the name anyway)
    mlxlm|mlxlm-blas) echo default_model;;  # mlx_lm.server: the --model it was started with
  esac
}

start_server() {  # $1 name, $2 port, $3 log
  local cmd
  case "$1" in
    tracer)
      cmd=("$TRACER" serve --model "$GGUF" --weights "${TRACER_WEIGHTS:-auto}" --buckets "$(echo 1 2 4 8 16 32 64 | tr ' ' '\n' | awk -v m="$SLOTS" '{print} $1>=m {exit}' | paste -sd,)" \
           --host 127.0.0.1 --port "$2" --log-level warning)
      local env=()
      [ "$THREADS" -lt "$NCPU" ] && env=(env MLX_TRACER_BLAS_THREADS="$THREADS")
      cmd=("${env[@]}" "${cmd[@]}");;
    llama)
      cmd=("$LLAMA_SERVER" -m "$GGUF" -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * 1024)) \
           --host 127.0.0.1 --port "$2" -a smollm2 --no-webui);;
    mlxlm)
      cmd=("$MLX_LM_SERVER" --model "$MLX_LM_DIR" --host 127.0.0.1 --port "$2" --log-level WARNING \
           --decode-concurrency "$(( SLOTS > 32 ? SLOTS : 32 ))");;
    mlxlm-blas)  # the same mlx_lm.server with mlx-tracer imported first (its BLAS shim under MLX)
      cmd=("$PY" -c 'import sys, mlx_tracer; sys.argv[0] = "mlx_lm.server"; from mlx_lm.server import main; main()' \
           --model "$MLX_LM_DIR" --host 127.0.0.1 --port "$2" --log-level WARNING \
           --decode-concurrency "$(( SLOTS > 32 ? SLOTS : 32 ))");;
  esac
  echo "  \$ ${PIN[*]} ${cmd[*]}" | tee -a "$3"
  setsid "${PIN[@]}" "${cmd[@]}" >>"$3" 2>&1 < /dev/null &
  SERVER_PID=$!
}

wait_ready() {  # $1 url, $2 log
  local t0=$SECONDS
  until waitfor answers "$1"; do
    kill -0 "$SERVER_PID" 2>/dev/null || { echo "  server exited; last log lines:" >&2; tail -20 "$2" >&2; return 1; }
    [ $((SECONDS - t0)) -lt "$READY_TIMEOUT" ] || { echo "  not ready after ${READY_TIMEOUT} s" >&2; return 1; }
    waitfor sleep 1
  done
  echo "  ready after $((SECONDS - t0)) s"
}

load1() { uptime | sed -E 's/.*load averages?: *//; s/,.*//'; }

run_load() {  # $1 url, $2 model, $3 clients, $4 tokens, $5 file for stdout, $6 file for stderr
  waitfor "$PY" "$SERVE_LOAD" "$1" --clients "$3" --tokens "$4" --model "$2" >"$5" 2>"$6"
}

if [[ ",$SERVERS," == *",mlxlm"* ]] && [ ! -f "$MLX_LM_DIR/config.json" ]; then
  echo "== building the mlx-lm folder $MLX_LM_DIR from $GGUF"
  "$PY" "$HERE/make_mlx_lm_model.py" --gguf "$GGUF" --out "$MLX_LM_DIR" || die "could not build $MLX_LM_DIR"
fi

echo "== clients $CLIENTS, tokens $TOKENS, reps $REPS, threads $THREADS (of $NCPU cores), servers $SERVERS; out $OUT"
echo "== load before: $(uptime)"
for rep in $(seq 1 "$REPS"); do
  for s in $(echo "$SERVERS" | tr ',' ' '); do
    port=$(port_of "$s"); [ -n "$port" ] || die "unknown server $s"
    url="http://127.0.0.1:$port"; log="$OUT/$s.rep$rep.log"
    echo "== rep $rep: $s on $url"
    if answers "$url"; then die "something already answers on $url"; fi
    start_server "$s" "$port" "$log"
    if ! wait_ready "$url" "$log"; then stop_server; echo "  skipped $s (rep $rep)"; continue; fi
    model=$(model_name "$s" "$url")
    # Warm-up: serve_load's own single request, then one round at the largest client count.
    # (Up to 3 tries: serve_load reuses the keep-alive connection of its own warm-up request,
    # and llama-server now and then closes it just then: "Server disconnected without sending
    # a response".)
    ok=""
    for try in 1 2 3; do
      if run_load "$url" "$model" "$MAXC" 8 "$OUT/$s.rep$rep.warmup" "$OUT/$s.rep$rep.warmup.$try.err"; then ok=1; break; fi
      echo "  warm-up try $try failed: $(tail -1 "$OUT/$s.rep$rep.warmup.$try.err")" >&2
    done
    [ -n "$ok" ] || { stop_server; echo "  skipped $s (rep $rep)"; continue; }
    for c in $(echo "$CLIENTS" | tr ',' ' '); do
      line=""
      for try in 1 2; do  # a failed run (a dropped stream) is reported, then run once more
        lb=$(load1)
        run_load "$url" "$model" "$c" "$TOKENS" "$OUT/$s.rep$rep.c$c.out" "$OUT/$s.rep$rep.c$c.$try.err"
        rc=$?
        la=$(load1)
        line=$(tail -1 "$OUT/$s.rep$rep.c$c.out")
        [ $rc -eq 0 ] && [ -n "$line" ] && break
        line=""
        echo "  $s, $c clients, try $try: serve_load failed (rc $rc): $(tail -1 "$OUT/$s.rep$rep.c$c.$try.err")" | tee -a "$OUT/failures.txt" >&2
      done
      [ -n "$line" ] || continue
      echo "  $line   [load $lb -> $la]"
      # "16 clients x 64 tokens: 1024 tokens in 8.6 s = 118.5 tok/s; TTFT p50 0.41 s, max 0.62 s; longest gap 0.30 s"
      echo "$line" | sed -E 's/^.*: ([0-9]+) tokens in ([0-9.]+) s = ([0-9.]+) tok\/s; TTFT p50 ([0-9.]+) s, max ([0-9.]+) s; longest gap ([0-9.]+) s.*$/\1 \2 \3 \4 \5 \6/' |
        { read -r n w tps p50 tmax gap; printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' \
            "$s" "$c" "$rep" "$n" "$w" "$tps" "$p50" "$tmax" "$gap" "$lb" "$la" >> "$RESULTS"; }
    done
    stop_server
  done
done
echo "== load after: $(uptime)"

echo
echo "== every run ($RESULTS)"
column -t -s $'\t' "$RESULTS"
echo
echo "== median over reps (tok/s: aggregate completion chunks per second; TTFT and gap in seconds)"
"$PY" - "$RESULTS" <<'EOF'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1]), delimiter="\t"))
names = {"tracer": "mlx-tracer serve", "llama": "llama-server", "mlxlm": "mlx_lm.server",
         "mlxlm-blas": "mlx_lm.server+blas"}
order = []
for r in rows:
    k = (r["server"], int(r["clients"]))
    if k not in order: order.append(k)
order.sort(key=lambda k: (-k[1], list(names).index(k[0]) if k[0] in names else 9))
print(f"{'server':18} {'clients':>7} {'reps':>4} {'tok/s':>8} {'(min-max)':>15} {'TTFT p50':>9} {'TTFT max':>9} {'gap max':>8} {'load1 before->after':>20}")
for s, c in order:
    rs = [r for r in rows if r["server"] == s and int(r["clients"]) == c]
    f = lambda key: [float(r[key]) for r in rs]
    med = lambda key: statistics.median(f(key))
    tps = f("tok_s")
    print(f"{names.get(s, s):18} {c:>7} {len(rs):>4} {med('tok_s'):>8.1f} {f'({min(tps):.1f}-{max(tps):.1f})':>15} "
          f"{med('ttft_p50'):>9.2f} {max(f('ttft_max')):>9.2f} {max(f('gap_max')):>8.2f} "
          f"{' '.join(r['load_before'] + '->' + r['load_after'] for r in rs):>20}")
EOF
