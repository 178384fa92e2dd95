#!/usr/bin/env bash
# The GPU tests (ctest -L gpu, registered in the CUDA build only; scripts/test-gpu.sh runs them on
# the GPU machine). Each case trains the example GPT through trainyard-trainer --device cuda, as
# the worker starts it, or through a local cluster, and checks what the issue asks of the GPU path.
#
#   bash tests/gpu_test.sh CASE BIN_DIR
set -euo pipefail
case_name=$1
bin=$(cd "$2" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
# TRAINYARD_GPU_LOGS: a folder that keeps every case's output, passed or failed (ctest shows
# failures' only); scripts/test-gpu.sh brings it back.
if [ -n "${TRAINYARD_GPU_LOGS:-}" ]; then
  mkdir -p "$TRAINYARD_GPU_LOGS"
  exec > >(tee -a "$TRAINYARD_GPU_LOGS/$case_name.log") 2>&1
fi
cleanup() {
  if [ -f "$work/cluster-up" ]; then
    HOME=$work "$bin/yard" local down --state-dir "$work/cluster" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "FAIL ($case_name): $*" >&2
  exit 1
}

# spec NAME STEPS PRECISION: the example GPT, STEPS steps, no periodic checkpoints.
spec() {
  sed -e "s/steps: 300/steps: $2/" -e 's/warmup: 30/warmup: 2/' \
    -e "s/mixed_precision: fp32/mixed_precision: $3/" -e 's/every_steps: 100/every_steps: 0/' \
    "$root/examples/char-gpt.yaml" >"$work/$1.yaml"
}
# train SPEC DEVICE CHECKPOINT_DIR [flags...]: the rank's log on stdout.
train() {
  local start=$SECONDS
  "$bin/trainyard-trainer" --spec "$work/$1.yaml" --job-id "" --attempt 1 --rank 0 \
    --world-size 1 --coordinator 127.0.0.1:1 --device "$2" --checkpoint-dir "$work/$3" \
    --threads 8 --metrics-file "$work/$3.jsonl" "${@:4}" >"$work/$3.log" 2>&1 || { tail -20 "$work/$3.log" >&2; fail "$3: trainer failed"; }
  echo "($3 on $2: $((SECONDS - start)) s)" >&2
  cat "$work/$3.log"
}
# losses RUN: the losses of run RUN (its checkpoint dir's name), in full, from the metrics file;
# stdin is ignored (the rank's log, which rounds them).
losses() {
  cat >/dev/null
  python3 -c "import json, sys; [print(repr(json.loads(l)['loss'])) for l in open(sys.argv[1])]" "$work/$1.jsonl"
}
# close A B REL: every line's values within REL of each other (relative to the larger).
close() {
  paste "$1" "$2" | tee -a /dev/stderr | awk -v rel="$3" '
    { d = $1 - $2; if (d < 0) d = -d; m = ($1 > $2 ? $1 : $2); if (m < 0) m = -m; if (m < 1) m = 1
      if (d > rel * m) bad = 1; if (d / m > worst) worst = d / m; n++ }
    END { printf "compared %d values: worst relative difference %.2e (allowed %.0e)\n", n, worst, rel > "/dev/stderr"
          exit (bad || n == 0) }'
}

# cluster_up WORKERS [flags...]: a local cluster on this host, on a port of its own (cases run
# side by side), yard's environment exported; more `yard local up` flags after WORKERS.
cluster_up() {
  export HOME=$work
  touch "$work/cluster-up"
  "$bin/yard" local up --state-dir "$work/cluster" --listen 127.0.0.1:0 --workers "$1" "${@:2}" \
    >"$work/up.log" 2>&1 || { cat "$work/up.log"; fail "local up"; }
  eval "$(grep '^export ' "$work/up.log")"
  "$bin/yard" nodes
}
# job_spec NAME STEPS [sed expressions...]: the example, STEPS steps, no periodic checkpoints, two
# ranks, edited by the expressions, as $work/NAME.yaml.
job_spec() {
  local edits=()
  for e in "${@:3}"; do edits+=(-e "$e"); done
  sed -e "s/steps: 300/steps: $2/" -e 's/warmup: 30/warmup: 2/' -e 's/every_steps: 100/every_steps: 0/' \
    "${edits[@]}" "$root/examples/char-gpt.yaml" >"$work/$1.yaml"
}
# run_job NAME STEPS: submits $work/NAME.yaml and waits for it; its losses (from yard metrics) go
# to $work/NAME.txt, its log to $work/NAME.log.
run_job() {
  local job
  job=$("$bin/yard" submit "$work/$1.yaml")
  "$bin/yard" wait "$job" --timeout 240s || { "$bin/yard" logs "$job" | tail -30; fail "$1: the job failed"; }
  "$bin/yard" logs "$job" >"$work/$1.log"
  grep -q "device: cuda:0" "$work/$1.log" || fail "$1: not on the GPU"
  "$bin/yard" -o json metrics "$job" |
    python3 -c "import json, sys; [print(repr(r['loss'])) for r in json.load(sys.stdin)]" >"$work/$1.txt"
  [ "$(wc -l <"$work/$1.txt")" -eq "$2" ] || fail "$1: expected $2 steps"
}

case "$case_name" in
  cpu_losses)
    # fp32, TF32 off (LibTorch's default): one GPU rank gives the CPU's losses over 10 steps;
    # once with the gradients through NCCL (one rank: buckets on NCCL's stream), once without.
    spec fp32 10 fp32
    train fp32 cpu cpu | losses cpu >"$work/cpu.txt"
    train fp32 cuda cuda | losses cuda >"$work/cuda.txt"
    TRAINYARD_NCCL_ONE_RANK=1 train fp32 cuda nccl | losses nccl >"$work/nccl.txt"
    grep -q "collectives: nccl" "$work/nccl.log" || fail "the NCCL run did not use NCCL"
    grep -q "device: cuda:0" "$work/cuda.log" || fail "the rank did not say it trains on cuda:0"
    # (One rank without NCCL replays its step as a CUDA graph from step 4; through NCCL, eager.)
    grep -q "cuda graphs: step 4 captured" "$work/cuda.log" || fail "the step was not captured"
    grep -q "cuda graphs: off (the gradients are averaged" "$work/nccl.log" ||
      fail "the NCCL run did not say why it has no graphs"
    [ "$(wc -l <"$work/cuda.txt")" -eq 10 ] || fail "expected 10 steps"
    close "$work/cpu.txt" "$work/cuda.txt" 1e-5 || fail "GPU losses differ from the CPU's"
    close "$work/cpu.txt" "$work/nccl.txt" 1e-5 || fail "GPU (NCCL) losses differ from the CPU's"
    ;;
  bf16)
    # bf16 autocast trains: the loss falls as fp32's does on the CPU.
    spec bf16 40 bf16
    spec fp32 40 fp32
    train bf16 cuda bf16 | losses bf16 >"$work/bf16.txt"
    train fp32 cpu fp32 | losses fp32 >"$work/fp32.txt"
    grep -q "precision bf16 (autocast" "$work/bf16.log" || fail "no autocast"
    first=$(head -1 "$work/bf16.txt")
    last=$(tail -1 "$work/bf16.txt")
    ref=$(tail -1 "$work/fp32.txt")
    echo "bf16 GPU: $first -> $last; fp32 CPU: $ref"
    awk -v a="$last" -v f="$first" -v r="$ref" 'BEGIN { exit !(a < f - 1.0 && (a - r < 0.05 * r && r - a < 0.05 * r)) }' ||
      fail "bf16 loss $last (from $first) not within 5% of fp32's $ref"
    ;;
  fp16_overflow)
    # fp16 with dynamic loss scaling: an overflow injected at step 3 skips exactly that step
    # (parameters as after step 2), halves the scale, and training goes on.
    # (--gemm-tune off: two processes compared to 1e-6 take the same product algorithms.)
    spec fp16_3 3 fp16
    spec fp16_2 2 fp16
    train fp16_3 cuda a --inject-overflow-at-step 3 --dump-params "$work/a.bin" --gemm-tune off >/dev/null
    train fp16_2 cuda b --dump-params "$work/b.bin" --gemm-tune off >/dev/null
    grep -q "step 3 skipped: inf or NaN gradients in fp16 (injected); loss scale 65536 -> 32768" "$work/a.log" ||
      fail "step 3 was not skipped"
    [ "$(grep -c skipped: "$work/a.log")" -eq 1 ] || fail "another step was skipped"
    python3 - "$work/a.bin" "$work/b.bin" <<'PY' || fail "the parameters after the skipped step are not step 2's"
import struct, sys
def read(path):
    b = open(path, "rb").read(); assert b[:8] == b"TYPDUMP1"; n, = struct.unpack_from("<I", b, 8); o = 12; out = {}
    for _ in range(n):
        l, = struct.unpack_from("<I", b, o); o += 4; name = b[o:o + l].decode(); o += l
        nd, = struct.unpack_from("<I", b, o); o += 4; dims = struct.unpack_from(f"<{nd}q", b, o); o += 8 * nd
        count = 1
        for d in dims: count *= d
        out[name] = struct.unpack_from(f"<{count}f", b, o); o += 4 * count
    return out
a, b = read(sys.argv[1]), read(sys.argv[2])
worst = max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))
print(f"largest parameter difference to the 2-step run: {worst:.2e}")
sys.exit(worst > 1e-6)
PY
    spec fp16_10 10 fp16
    train fp16_10 cuda c | losses c >"$work/c.txt"
    ! grep -q skipped: "$work/c.log" || fail "a clean fp16 run skipped a step"
    awk 'NR == 1 { f = $1 } END { exit !($1 < f) }' "$work/c.txt" || fail "fp16 did not train"
    ;;
  checkpoint_devices)
    # A GPU job resumes on the CPU and a CPU job on the GPU, with the losses of a run that
    # stayed on one device (fp32; 1e-4); fp16's loss scale travels in the checkpoint.
    spec fp32 6 fp32
    train fp32 cuda whole | losses whole >"$work/whole.txt"
    train fp32 cuda g2c --stop-after-steps 4 >/dev/null
    train fp32 cpu g2c | losses g2c >"$work/g2c.txt"  # both runs' steps, appended
    train fp32 cpu c2g --stop-after-steps 4 >/dev/null
    train fp32 cuda c2g | losses c2g >"$work/c2g.txt"
    close "$work/whole.txt" "$work/g2c.txt" 1e-4 || fail "GPU -> CPU resume changed the losses"
    close "$work/whole.txt" "$work/c2g.txt" 1e-4 || fail "CPU -> GPU resume changed the losses"
    spec fp16 6 fp16
    train fp16 cuda amp --stop-after-steps 3 --inject-overflow-at-step 2 >/dev/null
    train fp16 cpu amp >/dev/null
    grep -q "dynamic loss scale from 32768" "$work/amp.log" || fail "the loss scale did not travel"
    ;;
  fsdp)
    # FSDP on the GPU. One rank over NCCL (a shard group of one) gives the CPU's FSDP losses, and
    # its sharded checkpoint resumes on the CPU with them; bf16 FSDP trains. Two ranks sharing
    # this GPU, started by a local cluster of two workers, give DDP's losses under every sharding
    # strategy (fp32, 1e-5 over 10 steps): their shards are gathered and their gradients
    # reduce-scattered between two processes, through Gloo over host copies
    # (TRAINYARD_COLLECTIVES=gloo), since NCCL refuses two ranks on one device.
    spec fp32 10 fp32
    sed -i 's/strategy: ddp, sharding_strategy: FULL_SHARD/strategy: fsdp, sharding_strategy: FULL_SHARD/' "$work/fp32.yaml"
    train fp32 cpu cpu | losses cpu >"$work/cpu.txt"
    TRAINYARD_NCCL_ONE_RANK=1 train fp32 cuda gpu | losses gpu >"$work/gpu.txt"
    grep -q "collectives: nccl" "$work/gpu.log" || fail "the one-rank FSDP run did not use NCCL"
    close "$work/cpu.txt" "$work/gpu.txt" 1e-5 || fail "GPU FSDP losses differ from the CPU's"
    train fp32 cuda g2c --stop-after-steps 4 >/dev/null
    train fp32 cpu g2c | losses g2c >"$work/g2c.txt"
    close "$work/gpu.txt" "$work/g2c.txt" 1e-4 || fail "a GPU FSDP checkpoint resumed on the CPU changed the losses"
    spec bf16 40 bf16
    sed -i 's/strategy: ddp, sharding_strategy: FULL_SHARD/strategy: fsdp, sharding_strategy: FULL_SHARD/' "$work/bf16.yaml"
    train bf16 cuda bf16 | losses bf16 >"$work/bf16.txt"
    awk 'NR == 1 { f = $1 } END { exit !($1 < f - 1.0) }' "$work/bf16.txt" || fail "bf16 FSDP did not train"

    export TRAINYARD_COLLECTIVES=gloo
    cluster_up 2
    job_spec ddp2 10
    run_job ddp2 10
    grep -q "collectives: gloo" "$work/ddp2.log" || fail "ddp2: the ranks did not use Gloo"
    for sharding in FULL_SHARD SHARD_GRAD_OP HYBRID_SHARD NO_SHARD; do
      job_spec "fsdp2-$sharding" 10 "s/strategy: ddp, sharding_strategy: FULL_SHARD/strategy: fsdp, sharding_strategy: $sharding/"
      run_job "fsdp2-$sharding" 10
      close "$work/ddp2.txt" "$work/fsdp2-$sharding.txt" 1e-5 || fail "FSDP $sharding on the GPU differs from DDP"
    done
    ;;
  model_parallel)
    # Pipelines on the GPU: two ranks sharing it (a local cluster of two workers; Gloo through
    # host copies, as in the fsdp case). Two stages with two micro-batches give DDP's losses over
    # two ranks (the same 16 windows a step), under both schedules (fp32, 1e-5 over 10 steps);
    # bf16 pipelines train. Tensor parallelism needs its group on one node, which a cluster of
    # one-GPU workers cannot give: the gpu_layouts test runs it (pipeline_e2e_test's ranks on the
    # GPU).
    export TRAINYARD_COLLECTIVES=gloo
    cluster_up 2
    job_spec ddp2 10
    run_job ddp2 10
    for schedule in 1f1b gpipe; do
      job_spec "pipe2-$schedule" 10 "s/strategy: ddp,/strategy: ddp, pipeline_stages: 2, pipeline_schedule: $schedule,/" \
        's/seed: 1}/seed: 1, micro_batches: 2}/'
      run_job "pipe2-$schedule" 10
      grep -q "pipeline stage 0/2" "$work/pipe2-$schedule.log" || fail "pipe2-$schedule: not two stages"
      close "$work/ddp2.txt" "$work/pipe2-$schedule.txt" 1e-5 || fail "the $schedule pipeline on the GPU differs from DDP"
    done
    job_spec pipe2-bf16 40 "s/strategy: ddp,/strategy: ddp, pipeline_stages: 2,/" 's/seed: 1}/seed: 1, micro_batches: 2}/' \
      's/mixed_precision: fp32/mixed_precision: bf16/'
    run_job pipe2-bf16 40
    grep -q "precision bf16 (autocast" "$work/pipe2-bf16.log" || fail "pipe2-bf16: no autocast"
    awk 'NR == 1 { f = $1 } END { exit !($1 < f - 1.0) }' "$work/pipe2-bf16.txt" || fail "a bf16 pipeline did not train"
    ;;
  offload)
    # Offload from the GPU: two ranks sharing it push their gradients (copied out into pinned
    # host memory as they complete) to a parameter server, which applies AdamW and sends the
    # parameters back; DDP's losses within 1e-4 over 10 steps (the server's CPU Adam against the
    # GPU's fused AdamW).
    export TRAINYARD_COLLECTIVES=gloo
    cluster_up 2 --ps 1
    job_spec ddp2 10
    run_job ddp2 10
    job_spec offload2 10 "s/strategy: ddp,/strategy: offload,/"
    run_job offload2 10
    grep -q "ps_push_bytes" "$work/offload2.log" || fail "offload2: nothing pushed to the server"
    close "$work/ddp2.txt" "$work/offload2.txt" 1e-4 || fail "offload from the GPU differs from DDP"
    ;;
  nccl_two_ranks)
    # Two ranks over NCCL on this one GPU, which NCCL refuses (two ranks on one device). What
    # must hold is that the job ends within 90 s, failed with NCCL named in the rank's error that
    # yard wait reports, rather than hung; or, where NCCL accepts it, trains over NCCL.
    cluster_up 2
    job_spec nccl2 10 's/max_restarts: 3/max_restarts: 0/'
    job=$("$bin/yard" submit "$work/nccl2.yaml")
    rc=0
    "$bin/yard" wait "$job" --timeout 90s >"$work/nccl2.wait" 2>&1 || rc=$?
    "$bin/yard" logs "$job" >"$work/nccl2.log" 2>&1 || true
    cat "$work/nccl2.wait"
    tail -15 "$work/nccl2.log"
    if [ "$rc" -eq 0 ]; then
      grep -q "collectives: nccl" "$work/nccl2.log" || fail "nccl2: not over NCCL"
      echo "NCCL ran two ranks on one GPU"
    else
      "$bin/yard" cancel "$job" >/dev/null 2>&1 || true
      # The job's end, as yard wait tells it: failed, the rank's error naming NCCL.
      grep "$job FAILED" "$work/nccl2.wait" | grep -qi "nccl" ||
        fail "nccl2: not failed within 90 s with NCCL named (yard wait: $rc; a hang?)"
      echo "NCCL refused two ranks on one GPU, and the job failed saying so"
    fi
    ;;
  optimizers)
    # Every optimizer on the GPU gives the CPU's losses under DDP and FSDP (one rank, over NCCL):
    # Lion in tensor operations, Adafactor and 8-bit AdamW stepped in host memory by the CPU
    # kernels (their state stays there); 1e-4 over 10 steps.
    for optimizer in lion adafactor adamw_8bit; do
      for strategy in ddp fsdp; do
        run=$optimizer-$strategy
        spec "$run" 10 fp32
        sed -i -e "s/seed: 1}/seed: 1, optimizer: $optimizer}/" \
          -e "s/strategy: ddp, sharding_strategy: FULL_SHARD/strategy: $strategy, sharding_strategy: FULL_SHARD/" \
          "$work/$run.yaml"
        train "$run" cpu "cpu-$run" | losses "cpu-$run" >"$work/cpu-$run.txt"
        TRAINYARD_NCCL_ONE_RANK=1 train "$run" cuda "gpu-$run" | losses "gpu-$run" >"$work/gpu-$run.txt"
        grep -q "optimizer $optimizer" "$work/gpu-$run.log" || fail "$run: not $optimizer"
        close "$work/cpu-$run.txt" "$work/gpu-$run.txt" 1e-4 || fail "$run: $optimizer on the GPU differs from the CPU"
      done
    done
    # A GPU checkpoint of 8-bit AdamW (codes and absmaxes) resumes on the CPU with the losses of
    # a run that stayed on the GPU.
    spec ckpt8 6 fp32
    sed -i 's/seed: 1}/seed: 1, optimizer: adamw_8bit}/' "$work/ckpt8.yaml"
    train ckpt8 cuda whole8 | losses whole8 >"$work/whole8.txt"
    train ckpt8 cuda g2c8 --stop-after-steps 3 >/dev/null
    train ckpt8 cpu g2c8 | losses g2c8 >"$work/g2c8.txt"
    close "$work/whole8.txt" "$work/g2c8.txt" 1e-4 || fail "an 8-bit GPU checkpoint resumed on the CPU changed the losses"
    ;;
  cuda_graphs)
    # The step as a CUDA graph, captured after 3 eager steps and replayed: fp32 with two
    # micro-batches a step (the accumulation inside the graph), a learning rate that changes every
    # step (warm-up, then cosine), an evaluation every 4 steps between replays and checkpoints at
    # steps 6 and 8 (a checkpoint must leave AdamW's moments where the graph reads them). The
    # eager steps' losses (--cuda-graphs off) and evaluation losses within 1e-5, and the CPU's; a checkpoint written after replays resumes (warm-up and a
    # capture again) with the straight run's losses (1e-5). bf16 trains with graphs as without.
    spec fp32 12 fp32
    sed -i -e 's/grad_accum: 1/grad_accum: 2/' -e 's/warmup: 2/warmup: 5/' -e 's/every_steps: 0/every_steps: 6/' \
      -e 's/seed: 1}/seed: 1, eval_every: 4, eval_batches: 1}/' \
      -e 's|format: bytes}|format: bytes, eval_path: /usr/share/common-licenses/GPL-2}|' "$work/fp32.yaml"
    train fp32 cuda graphed | losses graphed >"$work/graphed.txt"
    train fp32 cuda eager --cuda-graphs off | losses eager >"$work/eager.txt"
    train fp32 cpu cpu | losses cpu >"$work/cpu.txt"
    grep "cuda graphs" "$work/graphed.log"
    grep -q "cuda graphs: on" "$work/graphed.log" || fail "graphs are not on"
    grep -q "cuda graphs: step 4 captured (inputs 8x129 8x129) after 3 eager steps" "$work/graphed.log" ||
      fail "the step was not captured at step 4"
    ! grep -q "cuda graphs: off from" "$work/graphed.log" || fail "the capture failed"
    ! grep -q "capture again" "$work/graphed.log" || fail "the graph was dropped and captured again"
    grep -q "cuda graphs: off (--cuda-graphs off)" "$work/eager.log" || fail "--cuda-graphs off was not said"
    [ "$(wc -l <"$work/graphed.txt")" -eq 12 ] || fail "expected 12 steps"
    # (1e-5: the fp32 attention's backward may sum in another order run to run.)
    close "$work/eager.txt" "$work/graphed.txt" 1e-5 || fail "the replayed steps differ from the eager ones"
    close "$work/cpu.txt" "$work/graphed.txt" 1e-5 || fail "the replayed steps differ from the CPU's"
    eval_losses() {
      python3 -c "import json, sys; [print(repr(r['eval_loss'])) for r in map(json.loads, open(sys.argv[1])) if 'eval_loss' in r]" "$work/$1.jsonl"
    }
    eval_losses graphed >"$work/graphed-eval.txt"
    eval_losses eager >"$work/eager-eval.txt"
    [ "$(wc -l <"$work/graphed-eval.txt")" -eq 3 ] || fail "expected evaluations after steps 4, 8 and 12"
    close "$work/eager-eval.txt" "$work/graphed-eval.txt" 1e-5 || fail "evaluations between replays differ"
    train fp32 cuda resumed --stop-after-steps 8 >/dev/null
    train fp32 cuda resumed | losses resumed >"$work/resumed.txt"  # both runs' steps, appended
    grep -q "resumed from .*step-8 at step 8" "$work/resumed.log" || fail "not resumed from step 8"
    grep -q "cuda graphs: step 12 captured" "$work/resumed.log" || fail "the resumed run did not capture"
    close "$work/graphed.txt" "$work/resumed.txt" 1e-5 || fail "a checkpoint written after replays resumed otherwise"
    spec bf16 30 bf16
    train bf16 cuda bf16-graphed | losses bf16-graphed >"$work/bf16-graphed.txt"
    train bf16 cuda bf16-eager --cuda-graphs off | losses bf16-eager >"$work/bf16-eager.txt"
    grep -q "cuda graphs: step 4 captured" "$work/bf16-graphed.log" || fail "bf16: the step was not captured"
    close "$work/bf16-eager.txt" "$work/bf16-graphed.txt" 1e-2 || fail "bf16 with graphs trains otherwise"
    ;;
  llama)
    # The Llama family on the GPU, from a Hugging Face folder (a random Llama written by the
    # trainer's own export, 2 layers, grouped-query attention): one GPU rank gives the CPU's losses
    # (fp32, 1e-5 over 10 steps) as Llama; as Mistral with a sliding window of 5 on 32-token
    # windows (SDPA with a banded boolean mask on the GPU, an explicit mask on the CPU), which must
    # train otherwise than without it; and under LoRA (only the adapters train). bf16 trains.
    dev=${TRAINYARD_GPU_TEST_DEVICE:-cuda}  # (cpu: to try the case's logic without a GPU)
    llama_spec() {  # NAME STEPS FROM PRECISION [train fields]; without FROM, exported at the end
      local export=", export: hf"
      [ -n "$3" ] && export=""
      cat >"$work/$1.yaml" <<SPEC
name: $1
resources: {slots: 1}
model: {kind: llama, ${3:+from: $3, }n_layer: 2, n_head: 4, n_kv_head: 2, d_model: 64, seq_len: 32, vocab: 256}
data: {path: /usr/share/common-licenses/GPL-3, format: bytes}
train: {steps: $2, micro_batch: 8, lr: 1.0e-3, warmup: $(($2 > 2 ? 2 : 0)), mixed_precision: $4, seed: 1${5:+, $5}}
checkpoint: {every_steps: 0$export}
SPEC
    }
    llama_spec init 1 "" fp32
    train init cpu init >/dev/null
    [ -f "$work/init/export/config.json" ] || fail "the export wrote no config.json"
    cp -r "$work/init/export" "$work/mistral"
    python3 - "$work/mistral/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=5)
json.dump(c, open(sys.argv[1], "w"))
PY
    for m in llama mistral; do
      from=$work/mistral
      [ $m = llama ] && from=$work/init/export
      llama_spec $m 10 "$from" fp32
      train $m cpu $m-cpu | losses $m-cpu >"$work/$m-cpu.txt"
      train $m "$dev" $m-gpu | losses $m-gpu >"$work/$m-gpu.txt"
      grep -q "device: $dev" "$work/$m-gpu.log" || fail "$m: not on $dev"
      [ "$(wc -l <"$work/$m-gpu.txt")" -eq 10 ] || fail "$m: expected 10 steps"
      close "$work/$m-cpu.txt" "$work/$m-gpu.txt" 1e-5 || fail "$m: GPU losses differ from the CPU's"
      [ "$dev" = cpu ] || grep -q "cuda graphs: step 4 captured" "$work/$m-gpu.log" || fail "$m: the step was not captured"
    done
    ! close "$work/llama-gpu.txt" "$work/mistral-gpu.txt" 1e-3 2>/dev/null || fail "the window changed nothing"
    llama_spec lora 10 "$work/mistral" fp32 "lora: {r: 4, alpha: 8, target_modules: [q_proj, v_proj, down_proj]}"
    train lora cpu lora-cpu | losses lora-cpu >"$work/lora-cpu.txt"
    train lora "$dev" lora-gpu | losses lora-gpu >"$work/lora-gpu.txt"
    close "$work/lora-cpu.txt" "$work/lora-gpu.txt" 1e-5 || fail "LoRA: GPU losses differ from the CPU's"
    llama_spec bf16 40 "$work/mistral" bf16
    train bf16 "$dev" bf16 | losses bf16 >"$work/bf16.txt"
    awk 'NR == 1 { f = $1 } END { exit !($1 < f - 0.5) }' "$work/bf16.txt" || fail "bf16 Mistral did not train"
    ;;
  cluster)
    # A local cluster on this GPU host: the worker offers the GPU, `yard` trains the example with
    # resources {slots: 1} on it, checkpoints on request, and the cancelled job frees the GPU for
    # the next one.
    export HOME=$work
    yard="$bin/yard"
    touch "$work/cluster-up"
    "$yard" local up --state-dir "$work/cluster" --workers 1 >"$work/up.log" 2>&1 || { cat "$work/up.log"; fail "local up"; }
    eval "$(grep '^export ' "$work/up.log")"
    "$yard" nodes | tee "$work/nodes.txt"
    grep -qi "gpu\|cuda\|nvidia" "$work/nodes.txt" || fail "the worker offers no GPU"
    sed -e 's/slots: 2/slots: 1/' -e 's/steps: 300/steps: 100000/' "$root/examples/char-gpt.yaml" >"$work/long.yaml"
    job=$("$yard" submit "$work/long.yaml")
    wait_log() {  # PATTERN SECONDS
      for _ in $(seq "$2"); do
        # (Captured first: grep -q would close the pipe early, a failure under pipefail.)
        log=$("$yard" logs "$job" 2>/dev/null || true)
        grep -q "$1" <<<"$log" && return 0
        sleep 1
      done
      "$yard" logs "$job" | tail -20
      fail "no '$1' in the job's log"
    }
    # (The example runs thousands of steps a minute on a GPU: its first lines leave the log's
    # window at once; every step line says how much GPU memory it took.)
    wait_log "device_peak_bytes" 120
    "$yard" checkpoint "$job"
    wait_log "checkpoint step" 60
    "$yard" cancel "$job" >/dev/null
    rc=0
    "$yard" wait "$job" --timeout 60s || rc=$?
    [ "$rc" -eq 2 ] || fail "the job did not end cancelled (yard wait: $rc)"
    for _ in $(seq 30); do
      [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && break
      sleep 1
    done
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] || fail "the GPU is still in use"
    sed -e 's/slots: 2/slots: 1/' -e 's/steps: 300/steps: 20/' -e 's/warmup: 30/warmup: 2/' \
      -e 's/every_steps: 100/every_steps: 0/' \
      "$root/examples/char-gpt.yaml" >"$work/short.yaml"
    job=$("$yard" submit "$work/short.yaml")
    "$yard" wait "$job" --timeout 120s || fail "the next job did not succeed on the freed GPU"
    log=$("$yard" logs "$job")
    grep -q "device: cuda:0" <<<"$log" || fail "the next job did not train on the GPU"
    grep -q "step 20/20 .* device_peak_bytes" <<<"$log" || fail "no GPU step lines"
    ;;
  *)
    fail "unknown case"
    ;;
esac
echo "PASS ($case_name)"
