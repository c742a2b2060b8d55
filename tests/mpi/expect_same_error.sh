#!/bin/sh
# Runs a command that must fail on every rank with the same message, and
# checks it: a non-zero exit, and `pattern` (a fixed string) on exactly
# `count` lines of the output (one per rank). The command runs under
# `timeout`, so a hang is a failure too.
#
# usage: expect_same_error.sh COUNT PATTERN TIMEOUT_SECONDS COMMAND...
count=$1
pattern=$2
limit=$3
shift 3
output=$(timeout "$limit" "$@" 2>&1)
status=$?
printf '%s\n' "$output"
if [ "$status" -eq 124 ]; then
  echo "FAIL: the command hung (killed after $limit s)"
  exit 1
fi
if [ "$status" -eq 0 ]; then
  echo "FAIL: the command succeeded; it should have failed"
  exit 1
fi
found=$(printf '%s\n' "$output" | grep -cF -- "$pattern")
if [ "$found" -ne "$count" ]; then
  echo "FAIL: expected $count line(s) with \"$pattern\", found $found"
  exit 1
fi
echo "PASS: exit status $status, \"$pattern\" on $count line(s)"
