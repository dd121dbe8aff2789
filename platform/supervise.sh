#!/bin/sh
# supervise.sh NAME COMMAND...: platform/Procfile's web and worker lines.
# COMMAND runs again each time it exits (a crash, the OOM killer), SUPERVISE_RESTART_S (2) later.
# Exiting within SUPERVISE_QUICK_S (10) of its start SUPERVISE_QUICK_TRIES (5) times in a row,
# it is given up with its status, and honcho stops the platform: a setting refused at startup
# (a system check) is then one message and a stop, not the same traceback every two seconds.
name=$1
shift
quick_s=${SUPERVISE_QUICK_S:-10}
tries=${SUPERVISE_QUICK_TRIES:-5}
pause=${SUPERVISE_RESTART_S:-2}
quick=0
while :; do
    started=$(date +%s)
    "$@"
    status=$?
    if [ $(($(date +%s) - started)) -lt "$quick_s" ]; then quick=$((quick + 1)); else quick=0; fi
    if [ "$quick" -ge "$tries" ]; then
        echo "$name exited with status $status $quick times in a row within ${quick_s} s of starting: giving up (its output above says why)"
        exit "$status"
    fi
    echo "$name exited with status $status; restarting it in ${pause} s"
    sleep "$pause"
done
