"""tests/suite.py runs the suite as four pytest processes: each test module in exactly one."""
from __future__ import annotations

from tests import suite


def _owned(args: list[str], module: str) -> bool:
    """Whether pytest given `args` (paths and --ignore=) collects `module`."""
    ignored = [arg.removeprefix("--ignore=") for arg in args if arg.startswith("--ignore=")]
    paths = [arg for arg in args if not arg.startswith("-")]

    def under(path: str) -> bool:
        return module == path or module.startswith(path + "/")

    # An ignore holds for what pytest finds inside a folder given, not for the folder itself.
    return any(module == path or (under(path) and not any(under(i) and i.startswith(path + "/") for i in ignored))
               for path in paths)


def test_every_test_module_runs_in_exactly_one_process():
    modules = sorted(str(p.relative_to(suite.ROOT)) for p in suite.TESTS.rglob("test_*.py"))
    commands = suite._commands()
    owners = {module: [name for name, args, _, _ in commands if _owned(args, module)] for module in modules}
    assert {module: names for module, names in owners.items() if len(names) != 1} == {}
    assert len(modules) > 100


def test_the_named_modules_exist_and_the_live_processes_ports_do_not_overlap():
    for path in (*suite.PATIENT, *suite.BACKGROUND_HEAVY, *suite.STAY):
        assert (suite.TESTS / path).exists(), path
    ranges = [range(int(low), int(high) + 1) for low, high in (r.split("-") for r in suite.PORT_RANGES)]
    assert not set(ranges[0]) & set(ranges[1])
    assert max(max(r) for r in ranges) < 32768  # below Linux's ephemeral ports
    assert [idle for _, _, idle, _ in suite._commands()] == [False, False, True, True]
