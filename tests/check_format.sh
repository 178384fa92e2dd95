#!/usr/bin/env bash
# Fails if any C++ source in the repository differs from what .clang-format asks for.
set -euo pipefail
cd "$1"
mapfile -t files < <(git ls-files '*.cc' '*.h' 2>/dev/null || find . -name '*.cc' -o -name '*.h' | grep -v '^./build')
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "not formatted (run clang-format -i): ${bad[*]}"
  exit 1
fi
echo "${#files[@]} files formatted"
