# Sourced by .ci/run (and usable on its own for a partial run): `record NAME
# PYTHON PYTEST-ARGS...` runs pytest, prints its failures and last lines, and
# adds a row (step, jax, python, passed, failed, seconds) to "$results"; `status`
# becomes 1 if pytest failed. Needs `tmp` (a folder for the logs), `results` and
# `status` set by the caller.
#
#   tmp=/tmp/part results=/tmp/part/results.tsv status=0; mkdir -p $tmp
#   printf 'step\tjax\tpython\tpassed\tfailed\tseconds\n' > $results
#   source .ci/_record.sh; record "checked mode" python -q tests/conformance
#   python .ci/versions_table.py $results --write

record() {
    local name="$1" py="$2"
    shift 2
    # The log's file name: the step's name with every character outside
    # [A-Za-z0-9._-] replaced (a step name such as "slow 4/6" holds a slash).
    local log="$tmp/${name//[^A-Za-z0-9._-]/_}.log" start end
    start=$(date +%s)
    "$py" -m pytest "$@" > "$log" 2>&1
    local rc=$?
    grep -E '^(FAILED|ERROR) ' "$log" | head -n 40
    tail -n 3 "$log"
    end=$(date +%s)
    local jax_version py_version passed failed
    jax_version=$("$py" -c "import jax; print(jax.__version__)" 2>/dev/null || echo "?")
    py_version=$("$py" -c "import platform; print(platform.python_version())")
    # pytest's last line: "N passed, M failed, K errors in ...".
    local summary
    summary=$(grep -E '[0-9]+ (passed|failed|errors?)' "$log" | tail -n 1)
    passed=$(echo "$summary" | grep -Eo '[0-9]+ passed' | grep -Eo '[0-9]+' || true)
    failed=$(echo "$summary" | grep -Eo '[0-9]+ (failed|errors?)' | grep -Eo '[0-9]+' | awk '{s += $1} END {print s + 0}')
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$jax_version" "$py_version" "${passed:-0}" "${failed:-0}" "$((end - start))" >> "$results"
    if [ "$rc" -ne 0 ]; then
        echo "FAILED: $name (exit $rc)"
        status=1
    fi
}

