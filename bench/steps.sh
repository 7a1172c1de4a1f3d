# Sourced by bench/h200_*.sh: run every step of a part, save each step's output, fail the
# part at the end if any step failed (after the other steps have run).
#   step NAME CMD...   CMD's stdout+stderr to the terminal and to $out/NAME.log; its exit
#                      status is the log's last line and, if not 0, a line of $failed_file
#   finish             the part's summary; exits 1 if a step failed, else 0
# Needs $out and $failed_file (removed here: it lists this run's failures only). Provenance: every step's JSON results carry their own; the .log files are
# covered by $out/provenance-<part>.json (python3 -m cpmoe.bench.provenance), which is the
# first step of every part. On a copy of the tree without .git, set CPMOE_GIT_COMMIT and
# CPMOE_GIT_DIRTY=0|1 to name the commit (cpmoe/bench/provenance.py).
failed=()
ran=0
rm -f "$failed_file"
# A time limit's TERM (`timeout` signals the whole process group) or an INT: the shell exits
# only once the running step has (bash runs a trap after its foreground command), so what
# that step cleans up on the signal, a server it launched, is gone before the next command
# after the part starts; without the trap the shell died at once, and a cut-off FP8 server
# still held 38 GB of an H100 when the next benchmark built its model (5faf414).
trap 'exit 143' TERM INT

step() {
  local name=$1
  shift
  local log="$out/$name.log" rc=0
  ran=$((ran + 1))
  echo "== $name: $*" | tee "$log"
  "$@" 2>&1 | tee -a "$log" || rc=$?  # pipefail: the command's status, not tee's
  echo "== $name: exit status $rc" | tee -a "$log"
  if [ "$rc" -ne 0 ]; then
    failed+=("$name")
    echo "$name: exit status $rc (output: $log)" >>"$failed_file"
  fi
}

finish() {
  if [ "${#failed[@]}" -ne 0 ]; then
    echo "== FAILED: ${#failed[@]} of $ran steps: ${failed[*]} (listed in $failed_file)"
    exit 1
  fi
  echo "== all $ran steps passed"
  exit 0
}
