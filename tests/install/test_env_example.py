""".env.example lists every setting read from the environment, each with the default the code has.

The reads are found in the source, not imported: django-environ's `env.<cast>("NAME", default=...)`
in config/settings.py, and os.environ's get/setdefault/[] in the launcher (platform/), in any
first-party module outside tests/ and bench/.
"""
import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import environ

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ["manage.py", "config", "tenants", "inference", "batches", "console", "kernels", "platform", "deploy"]
ENV_CASTS = {"str", "int", "float", "bool", "list", "tuple", "dict", "json", "url", "db", "db_url", "cache", "path"}
# Read from the environment but no setting of the platform's.
NOT_SETTINGS = {
    "DJANGO_SETTINGS_MODULE": "Django's own: it names the settings module that reads .env",
    "MAX_JOBS": "torch's C++ build parallelism, set for its compiler (kernels/cpu_ext.py)",
    "PATH": "the shell's; the launcher puts the virtualenv first",
}
REQUIRED = object()  # a read without a default: the setting must be given
COMPUTED = object()  # a default the code works out (from another setting, the host, the checkout)


@dataclass(frozen=True)
class Read:
    where: str
    cast: str  # the django-environ cast; "str" for os.environ
    default: object


def _default(node: ast.expr | None) -> object:
    if node is None:
        return REQUIRED
    try:  # constants and arithmetic on them (64 * 1024); a name or a call is computed
        return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}}, {})
    except NameError:
        return COMPUTED


def _is_environ(node: ast.expr) -> bool:
    """os.environ, or a name bound to it (the launcher's `env = os.environ`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name) and node.id == "env")


def _reads(path: Path) -> list[tuple[str, Read]]:
    where = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=where)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            name, method = node.args[0], node.func.attr
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            receiver = node.func.value
            if isinstance(receiver, ast.Name) and receiver.id == "env" and method in ENV_CASTS:
                found.append((name.value, Read(where, method, _default(keywords.get("default")))))
            elif _is_environ(receiver) and method in ("get", "setdefault"):
                default = node.args[1] if len(node.args) > 1 else keywords.get("default")
                # os.environ.get("X") without a default is None: optional, not required.
                found.append((name.value, Read(where, "str", COMPUTED if default is None else _default(default))))
            elif isinstance(receiver, ast.Name) and receiver.id == "os" and method == "getenv":
                default = node.args[1] if len(node.args) > 1 else None
                found.append((name.value, Read(where, "str", COMPUTED if default is None else _default(default))))
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value)
              and isinstance(node.slice, ast.Constant)):
            found.append((node.slice.value, Read(where, "str", REQUIRED)))
    return found


@functools.cache
def settings_read() -> dict[str, list[Read]]:
    files = [p for entry in FIRST_PARTY for p in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry])]
    reads: dict[str, list[Read]] = {}
    for path in files:
        for name, read in _reads(path):
            reads.setdefault(name, []).append(read)
    return reads


def listed() -> dict[str, str]:
    """NAME -> value of each `#NAME=value` (or `NAME=value`) line of .env.example."""
    lines = (ROOT / ".env.example").read_text().splitlines()
    pairs = [m.groups() for m in map(re.compile(r"#?([A-Z][A-Z0-9_]*)=(.*)").fullmatch, lines) if m]
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), f"listed twice: {sorted({n for n in names if names.count(n) > 1})}"
    return dict(pairs)


def _parse(cast: str, value: str) -> object:
    """The value as the code would read it from the environment."""
    env = environ.Env()
    env.ENVIRON = {"SETTING": value}
    return getattr(env, cast)("SETTING")


def _matches(read: Read, value: str) -> bool:
    try:
        return _parse(read.cast, value) == read.default
    except (ValueError, environ.ImproperlyConfigured):
        return False


def test_the_reads_are_found():
    # The scan itself: a few reads of each kind, from settings and from the launcher.
    reads = settings_read()
    assert reads["INFERENCE_KV_CACHE_BYTES"] == [Read("config/settings.py", "int", 512 * 1024**2)]
    assert Read("config/settings.py", "str", REQUIRED) in reads["SECRET_KEY"]
    assert reads["DEBUG"] == [Read("config/settings.py", "bool", COMPUTED)]
    assert Read("platform/run.py", "str", "2048") in reads["WEB_BACKLOG"]
    assert reads["REPLICAS"] == [Read("platform/cluster.py", "str", "2")]
    assert {r.where for r in reads["PORT"]} == {"config/settings.py", "platform/run.py", "platform/cluster.py"}


def test_every_setting_is_listed_and_every_listed_one_is_read():
    reads, names = settings_read(), set(listed())
    settings = set(reads) - set(NOT_SETTINGS)
    assert not settings - names, f"read from the environment but missing from .env.example: {sorted(settings - names)}"
    assert not names - settings, f"in .env.example but read nowhere: {sorted(names - settings)}"
    assert set(NOT_SETTINGS) <= set(reads), f"no longer read, drop from NOT_SETTINGS: {set(NOT_SETTINGS) - set(reads)}"


def test_each_listed_value_is_the_default():
    # A written value must be what every read with a constant default falls back to; an empty one
    # is for defaults the code computes or settings production requires (the comment says which).
    reads, wrong = settings_read(), []
    for name, value in listed().items():
        constant = [r for r in reads.get(name, []) if r.default not in (REQUIRED, COMPUTED)]
        if value and not constant:
            wrong.append(f"{name}={value}: its default is computed or required; leave the value empty")
        elif value:
            wrong += [f"{name}={value}: the default in {r.where} is {r.default!r}" for r in constant if not _matches(r, value)]
        elif not any(r.default is REQUIRED for r in reads.get(name, [])) and not all(_matches(r, "") for r in constant):
            wrong.append(f"{name}= : write its default, {[r.default for r in constant]}")
    assert not wrong, "\n".join(wrong)
