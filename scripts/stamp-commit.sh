#!/usr/bin/env bash
# Write the checkout's commit and dirty flag into .gpu-commit/commit (ignored by git), to copy to the
# GPU host with the checkout: that host has no git, and gpu-setup.sh exports them for the runs'
# provenance.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
mkdir -p .gpu-commit
dirty=false
[ -n "$(git status --porcelain --untracked-files=no)" ] && dirty=true
echo "$(git rev-parse HEAD) $dirty" > .gpu-commit/commit
cat .gpu-commit/commit
