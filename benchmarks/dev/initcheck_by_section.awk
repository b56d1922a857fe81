# Count compute-sanitizer initcheck errors per "--- name" section printed by sanitize_ops.py.
/^--- / { sec=$0 } /Uninitialized/ { n[sec]++ } /^--- / { order[++k]=$0 }
END { for (i=1;i<=k;i++) printf "%-60s initcheck errors: %d\n", order[i], n[order[i]]+0 }
