"""What the management commands share: finding a tenant or a key from what an operator types."""
from django.core.management.base import CommandError

from tenants.models import ApiKey, Tenant

# A command's writes are staff writes: the audit log names them so (with the OS user when known).
ACTOR = "manage.py"


def tenant(ref: str) -> Tenant:
    """A tenant by name, else by id."""
    found = Tenant.objects.select_related("tier").filter(name=ref).first()
    if found is None and ref.isdigit():
        found = Tenant.objects.select_related("tier").filter(pk=int(ref)).first()
    if found is None:
        raise CommandError(f"No tenant named {ref!r}.")
    return found


def api_key(ref: str) -> ApiKey:
    """A key by its prefix (`sk-ab12cd34ef56`, with or without `sk-`, or the whole key)."""
    prefix = ref.removeprefix("sk-").split("_", 1)[0]
    found = ApiKey.objects.select_related("tenant").filter(prefix=prefix).first()
    if found is None:
        raise CommandError(f"No key with the prefix {prefix!r}.")
    return found


def actor() -> str:
    import getpass

    try:
        return f"{ACTOR} ({getpass.getuser()})"
    except (KeyError, OSError):  # no user name for this uid (a container)
        return ACTOR
