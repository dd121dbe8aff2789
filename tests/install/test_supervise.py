"""platform/supervise.sh, which `make run`'s Procfile runs the web process and the worker under:
restarted when they exit, given up (and the platform stopped by honcho) when they keep exiting
right after they start, as a setting refused at startup makes them do. The old Procfile loop
restarted them every two seconds forever, printing the same traceback each time."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE = ROOT / "platform" / "supervise.sh"


def _supervise(tmp_path: Path, script: str, tries: int, quick_s: int = 2) -> tuple[int, int, str]:
    """(its exit status, how many times the command started, what it printed)"""
    env = {**os.environ, "SUPERVISE_QUICK_TRIES": str(tries), "SUPERVISE_QUICK_S": str(quick_s),
           "SUPERVISE_RESTART_S": "0.1", "STARTS": str(tmp_path / "starts")}
    done = subprocess.run(["sh", str(SUPERVISE), "thing", "sh", "-c", f'echo x >> "$STARTS"; {script}'], env=env,
                          capture_output=True, text=True, timeout=60)
    return done.returncode, len((tmp_path / "starts").read_text().splitlines()), done.stdout


def test_a_command_that_keeps_failing_at_start_is_given_up_with_its_status(tmp_path):
    status, starts, said = _supervise(tmp_path, "exit 3", tries=3)
    assert (status, starts) == (3, 3)
    assert said.count("restarting it") == 2
    assert "thing exited with status 3 3 times in a row within 2 s of starting: giving up" in said


def test_a_command_that_ran_a_while_before_it_failed_starts_the_count_again(tmp_path):
    # Starts 1-2 fail at once, start 3 runs 3 s first (a crash in service), then 4-6 fail at once.
    # (Whole seconds: a quick start that crosses one counts 1 s, under the 2 s of quick_s.)
    script = '[ "$(wc -l < "$STARTS")" -eq 3 ] && sleep 3; exit 1'
    status, starts, said = _supervise(tmp_path, script, tries=3)
    assert (status, starts) == (1, 6), said
