#!/usr/bin/env bash
# Lint and format check of dcpkit with ruff (settings: [tool.ruff] in pyproject.toml).
#
#   bash scripts/lint.sh            # check the whole checkout: ruff check and ruff format --check
#   bash scripts/lint.sh PATH...    # only these files or folders
#   bash scripts/lint.sh --help     # this text
#
# Exit status 0 when both pass, 1 when either finds something, 2 when ruff is not installed
# (pip install '.[lint]') or an option is unknown. Changes nothing; to apply the fixes ruff can
# make by itself:
#   ruff check --fix PATH... && ruff format PATH...
# Findings are listed one a line (--output-format concise); ruff check PATH shows each in full.
set -uo pipefail

usage() {  # the comment block at the top of this file
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}
for a in "$@"; do
    case "$a" in
        -h|--help) usage; exit 0 ;;
        -*) echo "lint.sh: unknown option '$a' (see bash scripts/lint.sh --help)" >&2; exit 2 ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if command -v ruff >/dev/null 2>&1; then
    RUFF=(ruff)
elif python3 -m ruff --version >/dev/null 2>&1; then
    RUFF=(python3 -m ruff)
else
    echo "lint: ruff is not installed: pip install '.[lint]'" >&2
    exit 2
fi

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(.)

echo "lint: $("${RUFF[@]}" --version) on ${targets[*]}"
rc=0
"${RUFF[@]}" check --no-cache --output-format concise "${targets[@]}" || rc=1
"${RUFF[@]}" format --check --no-cache "${targets[@]}" || rc=1
if [ "$rc" -eq 0 ]; then
    echo "lint: OK"
else
    echo "lint: FAILED (ruff check / ruff format --check above)" >&2
fi
exit "$rc"
