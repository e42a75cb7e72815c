# Sourced by the install scripts (bootstrap.sh, install-cuda.sh, install-vllm.sh): a pip install
# that says what it is doing. pip -q prints nothing for minutes (torch and its CUDA libraries are
# gigabytes); plain pip prints pages. This prints one line per wheel as its download starts (name
# and size), the number of packages when the install starts, and every 15 s while pip runs a
# line with the time so far and the size of the folder being filled (the unpacking of large
# wheels prints nothing else). pip runs unbuffered, so that each line comes when pip says it.
#
#   pip_progress LABEL DIR PYTHON [pip install arguments...]
#
# LABEL prefixes every line; DIR is the folder whose size is shown (the environment, or
# --target's folder). pip's standard error is left as it is (callers capture it); the exit status
# is pip's.
pip_progress() {
  local label=$1 dir=$2 python=$3
  shift 3
  local start beat rc errexit=
  start=$(date +%s)
  case $- in *e*) errexit=1 ;; esac
  (
    while sleep 15 >/dev/null 2>&1; do
      echo "$label: ... $(( $(date +%s) - start )) s, $(du -sh "$dir" 2>/dev/null | cut -f1) in $dir"
    done
  ) &
  beat=$!
  set +e
  PYTHONUNBUFFERED=1 "$python" -m pip install --progress-bar off "$@" | _pip_progress_lines "$label"
  rc=${PIPESTATUS[0]}
  kill "$beat" 2>/dev/null
  wait "$beat" 2>/dev/null
  [ -z "$errexit" ] || set -e
  [ "$rc" -ne 0 ] || echo "$label: done in $(( $(date +%s) - start )) s, $(du -sh "$dir" 2>/dev/null | cut -f1) in $dir"
  return "$rc"
}

# The lines of pip's output worth showing, as they come (a shell loop: mawk, Debian's awk, reads
# a pipe in blocks and would hold them back).
_pip_progress_lines() {
  local label=$1 line n
  while IFS= read -r line; do
    case $line in
      *Downloading*.whl.metadata*) ;;
      *Downloading*.whl\ \(*) echo "$label: downloading ${line#*Downloading }" ;;
      "Installing collected packages: "*)
        n=$(tr ',' '\n' <<<"${line#*: }" | grep -c .)
        echo "$label: installing $n packages" ;;
    esac
  done
}
